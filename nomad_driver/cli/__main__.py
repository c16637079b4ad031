from nomad_driver.cli import main

main()

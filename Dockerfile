# The image for llmgw's own jobs (watcher, router, node agent): llmgw and nothing else. The
# engines are not in it; they live on the GPU nodes (docs/operating.md).
#
#   docker build -t registry.example.com/llmgw:0.1.0 .
#   docker push registry.example.com/llmgw:0.1.0
#
# Only the package is copied, not the checkout: a .venv/ or .devstack/ in the build context
# would otherwise end up in the image.
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md ./
COPY nomad_driver/ nomad_driver/
COPY router/ router/
RUN pip install --no-cache-dir . && rm -rf /src

# None of the three writes to disk or binds a port below 1024, so none needs root.
RUN useradd --system --uid 10001 --no-create-home llmgw
USER llmgw
WORKDIR /

ENTRYPOINT ["llmgw"]
CMD ["--help"]

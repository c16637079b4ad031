"""Where a running dev stack answers, and the environment that reaches it: what `.devstack/env`
exports, the tour prints and `state.json` keeps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Addresses:
    consul: str = ""
    nomad: str = ""
    router: str = ""
    admin: str = ""
    prometheus: str = ""
    watchers: list[str] = field(default_factory=list)
    # With ACLs on: the operator's tokens (llmgw-operator, for plan and apply), the admin token
    # and the router's API key.
    nomad_token: str = ""
    consul_token: str = ""
    # With --tls: the CAs that signed the stand-in's and Consul's certificates.
    nomad_cacert: str = ""
    consul_cacert: str = ""
    admin_token: str = ""
    api_key: str = ""

    def env(self) -> dict[str, str]:
        env = {
            "NOMAD_ADDR": self.nomad,
            "CONSUL_HTTP_ADDR": self.consul,
            "LLMGW_ADMIN_ADDR": self.admin,
            "LLMGW_ROUTER_URL": self.router,
            "OPENAI_BASE_URL": f"{self.router}/v1",
            "PROMETHEUS_ADDR": self.prometheus,
        }
        if self.nomad_cacert:
            env["NOMAD_CACERT"] = self.nomad_cacert
        if self.consul_cacert:
            env["CONSUL_CACERT"] = self.consul_cacert
        if self.nomad_token:
            env["NOMAD_TOKEN"] = self.nomad_token
        if self.consul_token:
            env["CONSUL_HTTP_TOKEN"] = self.consul_token
        if self.admin_token:
            env["LLMGW_ADMIN_TOKEN"] = self.admin_token
        if self.api_key:
            env["OPENAI_API_KEY"] = self.api_key  # what the openai SDKs send when given no key
        return env

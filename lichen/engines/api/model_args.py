"""What a launched `lichen serve` is told of the run's model code (--model-impl, --trust-remote-code,
--qwen-gdn-backend; both commands define them with lichen.config.model_code.add_model_code_args)."""

from __future__ import annotations


def launch_model_args(options: dict | None) -> list[str]:
    """`lichen serve` flags that give a launched server the run's model code (`options`: load_model's impl /
    trust_remote_code / gdn_backend); flags at serve's defaults are left out."""
    options = options or {}
    out = []
    if options.get("impl", "auto") != "auto":
        out += ["--model-impl", options["impl"]]
    if options.get("trust_remote_code"):
        out.append("--trust-remote-code")
    if options.get("gdn_backend"):
        out += ["--qwen-gdn-backend", options["gdn_backend"]]
    return out

"""Tooling around the gateway, never imported by the served gateway: `gateway demo` (`agent`, `train`), the
tiny model it builds (`tiny_model`), and the child processes it starts (`process`, `vllm_server`,
`launcher`; the tests and benchmarks use them too). Needs the `demo` extra.
"""

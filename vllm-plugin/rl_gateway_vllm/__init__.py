"""rl-gateway's vLLM endpoint plugin: vLLM's chat and completions replies gain, per choice, the spans of
output tokens each weight version sampled (`weight_versions`), which vLLM 0.32 computes for every request but
returns from `/inference/v1/generate` alone. Loaded by vLLM's API server when `VLLM_PLUGINS` names
`rl_gateway`; never imported by the gateway, which reads the field from the replies."""

__version__ = "0.1.0"

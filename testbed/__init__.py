"""What the tests, the benchmarks and the demo run on, never shipped in the wheel: the tiny model they build
(`tiny_model`) with its chat-template families (`families`), and the child processes they start (`process`,
`vllm_server`, `launcher`). The demo itself is `testbed.demo` (`scripts/dev demo`)."""

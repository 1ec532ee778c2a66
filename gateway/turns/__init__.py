"""The shared core of every agent call, whatever its wire dialect: admission and limits (`admission`), the
capture of the engine's token ids (`capture`), the trip to the backend (`upstream`, `forward`; exact mode in
`exact`, `splice`), the stream frame (`relay`, `sse`) and the recording of the outcome
(`recording`). A dialect (`gateway.openai`) parses its requests and writes replies through a `wire.Wire`.
"""

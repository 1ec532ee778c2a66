"""The shared core of every agent call, whatever its wire dialect: the intake (`intake`: the route, the body
read once and checked against the chat request every dialect forwards, `requests`), admission and limits
(`admission`), the capture of the engine's token ids (`capture`), the trip to the backend (`upstream`,
`forward`; exact mode in `exact`, `splice`), the stream frame (`relay`, `sse`) and the recording of the
outcome (`recording`). A dialect (`gateway.openai`, `gateway.anthropic`, `gateway.responses`) translates its
requests to that chat request and writes replies through a `wire.Wire`; no dialect imports another.
"""

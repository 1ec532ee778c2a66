"""The Anthropic Messages dialect of the agent API (`/rollouts/{rollout_id}/v1/messages`): Claude Code and
the Claude Agent SDK talk to the gateway as to Anthropic's API; each call is captured as a chat turn."""

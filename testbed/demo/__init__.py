"""The demo (`scripts/dev demo`): an agent through the gateway (`agent`), or training through it (`train`,
with the distillation teacher of `teacher`)."""

"""LoRA policies: adapters the fleet serves on a base model, each version under a name of its own.

vLLM hashes an adapter's prefix-cache blocks with its name and path, and re-reads an adapter from its path
whenever its cache evicted it: a version reloaded in place under the same name reuses blocks the old weights
computed, and files overwritten under a loaded name are read half old, half new. So each version is published
under its own name (`agent@3-1f2e3d4c`: `AdapterVersion.name`) from its own directory, loaded on every server
before calls go to it, and the names past the keep window are unloaded once no call holds them. An agent asks
for the policy (`agent`); the gateway sends its call to the live version's name and answers with the policy's
name, and the turn records the version that sampled it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.fleet.prefixes import adapter_key
from gateway.store.run_state import AdapterVersion

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
"""vLLM's calls that load and unload an adapter at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`)."""


@dataclass
class FleetAdapters:
    """The LoRA policies this process serves and their versions, as the run state says, with the calls of
    this process that hold each version."""

    bases: dict[str, str] = field(default_factory=dict)
    """Each LoRA policy's base model (`--lora-policy NAME=BASE`)."""
    keep: int = 2
    """Versions of each policy kept loaded, the live one included (--lora-keep)."""
    versions: list[AdapterVersion] = field(default_factory=list)
    """Loaded (or being retired), oldest first: the last of a policy that is not retired is its live one."""
    holds: Counter[str] = field(default_factory=Counter)
    """Calls of this process in flight on each version's name."""
    freed: Callable[[], None] = lambda: None
    """Told when this process's last call on a retired version ended (it may be unloaded now)."""

    def live(self, policy: str) -> AdapterVersion | None:
        """The version new calls of `policy` go to; None before its first is published."""
        return next((v for v in reversed(self.versions) if v.policy == policy and not v.retired), None)

    def key(self, model: str | None) -> int:
        """Where the prefix index keys the blocks of a call of `model` from (`adapter_key`): an adapter
        version's own, 0 for a model's own weights."""
        return adapter_key(model) if any(v.name == model for v in self.versions) else 0

    def hold(self, name: str) -> None:
        self.holds[name] += 1

    def release(self, name: str) -> None:
        self.holds[name] -= 1
        if self.holds[name] <= 0:
            del self.holds[name]
            if any(v.name == name and v.retired for v in self.versions):
                self.freed()

    def serving(self, base: frozenset[str]) -> list[AdapterVersion]:
        """The versions a server whose models are `base` must hold: every policy's not retired on a base it
        serves."""
        return [v for v in self.versions if not v.retired and self.bases.get(v.policy) in base]


Call = Callable[[str, object], Awaitable[str | None]]
"""POST (url, body) to a server: what went wrong, or None (`EngineClient.call_one`)."""

_LOADED = "has already been loaded"
"""How vLLM refuses a name it holds: a load that a health check made meanwhile, or one repeated."""


async def load(call: Call, url: str, version: AdapterVersion) -> str | None:
    """Load `version` on the server at `url`; what went wrong, or None (it holds it)."""
    failure = await call(url + LOAD, {"lora_name": version.name, "lora_path": version.path})
    return None if failure is not None and _LOADED in failure else failure


async def unload(call: Call, url: str, name: str) -> str | None:
    """Unload a version by name: vLLM forgets the name, its calls in flight finish."""
    return await call(url + UNLOAD, {"lora_name": name})

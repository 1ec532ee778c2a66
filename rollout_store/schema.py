"""Tables of the store: the single definition shared by the gateway, `trainer_client` and the migrations.

Time columns are seconds since the Unix epoch (float) so that durations are plain subtractions in SQLite and
PostgreSQL alike. Token columns hold packed arrays (see `rollout_store.tokens`). A turn stores only what is
new against the turn it extends (its parent, else the turn it was forked from): `prefix_tokens` ids are
shared with that turn's prompt + completion and `prompt_ids` holds the rest; `prefix_messages` messages are
shared with its request and `messages` holds the rest. Storage grows linearly with a rollout's length.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB
from sqlalchemy.engine import Dialect


class NulFreeText(TypeDecorator[str]):
    """PostgreSQL text cannot hold NUL characters, which a model can sample and an agent can send: they are
    stored as U+FFFD there (SQLite keeps them). The token ids are exact either way."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return _without_nul(value)


class NulFreeName(TypeDecorator[str]):
    """A bounded name (a task id, a model) as `NulFreeText` stores text."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return _without_nul(value)


def _without_nul(value: str | None) -> str | None:
    return value.replace("\x00", "\ufffd") if value is not None and "\x00" in value else value


SafeText = Text().with_variant(NulFreeText(), "postgresql")
SafeName = String(256).with_variant(NulFreeName(256), "postgresql")
"""The API takes names of 256 characters at most; the store's column holds as many."""
Json = JSON().with_variant(JSONB(), "postgresql")
ExactJson = JSON()
"""What agents and engines exchanged: `json` on PostgreSQL, kept as sent (jsonb would reorder object keys, and
a tool schema read back would render differently)."""
Blob = LargeBinary().with_variant(BYTEA(), "postgresql")
BigId = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

rollouts = Table(
    "rollouts",
    metadata,
    Column("rollout_id", String(128), primary_key=True),
    Column("group_id", String(128), nullable=False),
    # How many members the group was declared with (POST /rollouts group_size; every member carries it): the
    # group is served only once that many have finished. Null: served once none of its members is running.
    Column("group_size", Integer),
    Column("task_id", SafeName),
    Column("metadata", Json, nullable=False),
    Column("status", String(16), nullable=False),
    Column("reward", Float),
    Column("reward_components", Json),
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float),
    # Trainer claims (see trainer_client.claims): who took the rollout, at which training step, when; and,
    # for a rollout taken but not trained on, why (stale, failed, error_turns, no_reward, late, all_failed).
    Column("claimed_by", String(128)),
    Column("claim_step", Integer),
    Column("claimed_at", Float),
    Column("skip_reason", String(32)),
    # A claim taken with a lease is given up at this time unless the trainer commits it first (a trainer
    # that died mid-step); null: held for good.
    Column("lease_until", Float),
    # How its turns' prompts are built: "exact" or "passthrough"; null: the gateway's --mode.
    Column("mode", String(16)),
    # Free labels from the orchestrator; `eval` is true when they include "eval": such rollouts are measured
    # (`trainer-client eval`), never claimed for training.
    Column("tags", Json),
    Column("eval", Boolean, nullable=False, server_default=false()),
    # With --rollout-keys: sha256 (hex) of the key the rollout's agent calls with; the key is never stored.
    Column("api_key_hash", String(64)),
    # {"max_turns", "max_context_tokens"} given at creation; null fields take the gateway's defaults.
    Column("limits", Json),
    # Sampling fields imposed on every call of the rollout (trainer-controlled sampling); null: the gateway's.
    Column("sampling", Json),
    # The vLLM server the rollout's calls go to, chosen on its first call (every replica routes there).
    Column("backend", String(256)),
    # Why the gateway stopped serving the rollout's agent (a limit: max_turns, max_context_tokens).
    Column("end_reason", String(32)),
    # The policy the rollout trains: as POST /rollouts declared it, else the model its first call asked for
    # (a LoRA policy's name, or a model's); trainers claim one policy's groups.
    Column("policy", SafeName),
    Index("ix_rollouts_group_id", "group_id"),
    Index("ix_rollouts_status", "status"),
    Index("ix_rollouts_claimed_by", "claimed_by"),
    # Running rollouts per server, counted to place each new one (`gateway.store.pins`).
    Index(
        "ix_rollouts_running_backend",
        "backend",
        postgresql_where=text("status = 'running'"),
        sqlite_where=text("status = 'running'"),
    ),
)

turns = Table(
    "turns",
    metadata,
    Column("turn_id", BigId, primary_key=True, autoincrement=True),
    Column("rollout_id", String(128), ForeignKey("rollouts.rollout_id"), nullable=False),
    Column("turn_index", Integer, nullable=False),
    Column("endpoint", String(16), nullable=False),
    Column("model", SafeName),
    Column("stream", Boolean, nullable=False),
    Column("status", String(16), nullable=False),
    Column("error", SafeText),
    Column("http_status", Integer),
    Column("backend", String(256)),
    # The server the rollout was moved off for this turn (it failed, was drained or removed); null otherwise.
    Column("repinned_from", String(256)),
    Column("policy_version", String(64)),
    Column("policy_version_end", String(64)),
    # The LoRA adapter version that sampled the turn, by its name on the servers (`agent@3`; its policy is
    # `model`, its version `policy_version`); null for a call to a model's own weights.
    Column("adapter", String(160)),
    Column("weight_versions", Json),
    # A turn that spanned a weight update (policy_version_end differs): whether the servers kept their KV
    # cache through it (true: its tokens after the update attend to keys and values the previous weights
    # computed; false: vLLM computed them again); null for a turn that spanned none.
    Column("cache_kept", Boolean),
    # What the agent asked: new messages (or a completions prompt), tools and every other request field.
    Column("prefix_messages", Integer, nullable=False),
    Column("messages", ExactJson),
    Column("prompt_text", SafeText),
    Column("tools", ExactJson),
    Column("params", ExactJson),
    # What the model answered, as the agent saw it.
    Column("content", SafeText),
    Column("reasoning", SafeText),
    Column("tool_calls", ExactJson),
    Column("finish_reason", String(32)),
    # An agent speaking another dialect than chat (Messages, Responses): its own request, without the
    # conversation (stored above as the chat messages the engine rendered).
    Column("request", ExactJson),
    # Responses: the response's id, by which previous_response_id and GET .../responses/{id} find the turn
    # (null with `store: false`).
    Column("response_id", String(64)),
    # A call with n > 1 stores one turn per choice; this is the choice's index in the reply.
    Column("choice_index", Integer, nullable=False, server_default="0"),
    # A client's retry (the same request body, hashed, sent again with a higher `attempt`: the SDKs' retry
    # count) repeats an earlier turn: `retry_of` is that turn's index, and trainers never take both.
    Column("request_hash", String(32)),
    Column("attempt", Integer, nullable=False, server_default="0"),
    Column("retry_of", Integer),
    # Exact engine tokens, and the turn's place in its rollout (see gateway.store.lineage and
    # rollout_store.delta).
    Column("parent_turn", Integer),
    Column("forked_from", Integer),
    Column("prefix_tokens", Integer, nullable=False),
    Column("drift_tokens", Integer),
    # Exact mode: "exact" (spliced onto the parent's ids), "render" (no parent: the plain render),
    # "re-rendered: ..." (the template changed earlier context: its render, with the model's replies as
    # sampled), or "fallback: <why>" (the plain render: this turn could not be spliced); null: passthrough.
    Column("splice", String(128)),
    Column("prompt_ids", Blob, nullable=False),
    Column("completion_ids", Blob, nullable=False),
    Column("completion_logprobs", Blob, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    # Timings.
    Column("started_at", Float, nullable=False),
    Column("first_token_at", Float),
    Column("finished_at", Float, nullable=False),
    UniqueConstraint("rollout_id", "turn_index", name="uq_turns_rollout_id_turn_index"),
    Index("ix_turns_response_id", "response_id"),
)

rewards = Table(
    "rewards",
    metadata,
    Column("reward_id", BigId, primary_key=True, autoincrement=True),
    Column("rollout_id", String(128), ForeignKey("rollouts.rollout_id"), nullable=False),
    Column("turn_index", Integer),
    Column("value", Float, nullable=False),
    Column("components", Json),
    Column("created_at", Float, nullable=False),
    Index("ix_rewards_rollout_id", "rollout_id"),
)

# A teacher's logprob of every sampled token of a turn (`trainer-client score`: on-policy distillation),
# packed like `completion_logprobs` and aligned with `completion_ids`; one row per turn and teacher name.
teacher_scores = Table(
    "teacher_scores",
    metadata,
    Column("turn_id", BigId, ForeignKey("turns.turn_id"), primary_key=True),
    Column("teacher", String(128), primary_key=True),
    # What the teacher server reported as its weights (its weight version, else the model it serves).
    Column("teacher_version", String(256), nullable=False),
    Column("logprobs", Blob, nullable=False),
    Column("scored_at", Float, nullable=False),
)

# The policy versions the run published, in order (`gateway.store.versions`): the full weights' (policy null:
# the version the gateway started with, then each `POST /admin/policy_version`) and each LoRA policy's (`POST
# /admin/adapters`). A token's staleness is counted in its policy's versions published after its own.
policy_versions = Table(
    "policy_versions",
    metadata,
    Column("seq", BigId, primary_key=True, autoincrement=True),
    Column("policy", String(256)),
    Column("version", String(64), nullable=False),
    Column("published_at", Float, nullable=False),
)

# The gateway's run state, shared by every gateway process on PostgreSQL (`gateway.store.run_state`): one row
# of what every process must hold alike, numbered by `epoch` (each change adds one and is announced with
# NOTIFY), the fleet's vLLM servers, the history of weight reloads, and the processes themselves with their
# heartbeats (`gateway.store.processes`).
run_state = Table(
    "run_state",
    metadata,
    Column("run_state_id", Integer, primary_key=True),
    Column("epoch", BigInteger, nullable=False),
    Column("policy_version", String(64), nullable=False),
    Column("paused", Boolean, nullable=False),
    # The pause's mode (wait, abort, keep) and the process whose admin call asked for it.
    Column("pause_mode", String(8)),
    Column("paused_by", String(64)),
    # Whether the last pause kept the servers' KV and prefix caches (POST /admin/pause clear_cache false).
    Column("cache_kept", Boolean, nullable=False, server_default=false()),
    # Weight reloads the servers have done, and the weight version they were given (null: never).
    Column("reloads", Integer, nullable=False),
    Column("weight_version", String(64)),
    # The LoRA policies' versions the servers hold, oldest first: [{policy, version, path, retired}].
    Column("adapters", Json),
    Column("changed_at", Float, nullable=False),
)

fleet_servers = Table(
    "fleet_servers",
    metadata,
    Column("url", String(256), primary_key=True),
    Column("draining", Boolean, nullable=False),
    # As the leading process's health checks found it: serving, the models it lists, its prefix-cache hit
    # rate (vLLM's own).
    Column("healthy", Boolean, nullable=False),
    Column("models", Json, nullable=False),
    Column("prefix_cache_hit_rate", Float),
    # Whether its replies carry each token's weight version (the project's vLLM plugin); null until checked.
    Column("weight_spans", Boolean),
    # The reloads and weight version this server holds: one behind the run state's takes no calls until it has
    # them.
    Column("reloads", Integer, nullable=False),
    Column("weight_version", String(64)),
    # Adapter versions it failed to load, with the reason ({name: reason}): it serves none of their policy's
    # calls until a retry loads them.
    Column("adapter_errors", Json),
    Column("added_at", Float, nullable=False),
)

weight_reloads = Table(
    "weight_reloads",
    metadata,
    Column("reload", Integer, primary_key=True, autoincrement=False),
    Column("epoch", BigInteger, nullable=False),
    Column("requested_by", String(64)),
    Column("at", Float, nullable=False),
)

gateway_processes = Table(
    "gateway_processes",
    metadata,
    Column("process_id", String(64), primary_key=True),
    Column("host", String(256), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("port", Integer, nullable=False),
    # Seconds since the Unix epoch on the database's clock (hosts' clocks may differ).
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    # The newest run state's epoch the process holds, its agent calls in flight and held by a pause, and the
    # calls it has seen end (a pause in abort mode waits until they stop ending).
    Column("applied_epoch", BigInteger, nullable=False),
    Column("in_flight", Integer, nullable=False),
    Column("waiting", Integer, nullable=False),
    Column("ended", BigInteger, nullable=False),
    # Its load per server, and its Prometheus samples: GET /admin/state and /metrics add up every process's.
    Column("loads", Json),
    # Its calls in flight on each LoRA adapter version ({name: calls}).
    Column("adapter_holds", Json),
    Column("metrics", Json),
)

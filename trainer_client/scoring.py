"""Teacher scores for on-policy distillation: a teacher vLLM's logprob of every token the policy sampled.

Each stored turn's exact ids (its prompt and completion as the engine saw and sampled them, never
re-tokenized) go to the teacher's `/v1/completions` as a token-id prompt with `prompt_logprobs: 0`, which
returns the teacher's logprob of every prompt token. Turns whose ids extend one another exactly (a multi-turn
conversation) ride on one request: the longest sequence's logprobs hold every earlier turn's. Scores are
written as each request returns, so an interrupted run keeps what it did and the next run does the rest.

The teacher must read ids as the policy does: before scoring, both servers decode their whole vocabularies
(`/detokenize`, special tokens included) and any difference refuses the teacher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson
from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from rollout_store import schema
from rollout_store.database import make_engine, redacted, require_current_schema
from training_data.teacher_scores import (
    ScoreFilter,
    TurnToScore,
    rollouts_to_score,
    save_scores,
    turns_to_score,
    unscored,
)

_VOCABULARY_CHUNK = 4096
"""Ids decoded per `/detokenize` call when comparing vocabularies."""
_ROLLOUTS_PER_READ = 64


class TeacherError(Exception):
    """The teacher cannot score these samples (unreachable, another model, another tokenizer)."""


@dataclass(frozen=True)
class TeacherInfo:
    version: str
    """The weight version the server reports (vLLM's `/weight_info`), else the model it serves (`root`)."""
    max_model_len: int


class Server:
    """A vLLM server's HTTP API, as the scorer uses it (`api_key`: its --api-key, for /v1)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.shown = redacted(self.url)
        """The URL as messages show it: a password of its user info (httpx's basic auth) hidden."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def decode(self, ids: list[int]) -> str:
        """The text of these ids, special tokens included (`/detokenize`)."""
        return str(self.post("/detokenize", {"tokens": ids})["prompt"])

    def get(self, path: str) -> dict[str, Any]:
        return self._answer(path, lambda: self._http.get(path))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        content = orjson.dumps(body)
        return self._answer(
            path, lambda: self._http.post(path, content=content, headers={"Content-Type": "application/json"})
        )

    def close(self) -> None:
        self._http.close()

    def _answer(self, path: str, send: Callable[[], httpx.Response]) -> dict[str, Any]:
        try:
            reply = send()
        except httpx.HTTPError as exc:
            raise TeacherError(f"{self.shown}{path}: {exc!r}") from exc
        if reply.status_code != 200:
            raise TeacherError(f"{self.shown}{path} answered {reply.status_code}: {reply.text[:300]}")
        answer: dict[str, Any] = orjson.loads(reply.content)
        return answer


class TeacherServer(Server):
    """The vLLM server of the teacher, serving `model`."""

    def __init__(self, url: str, model: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(url, api_key=api_key, timeout=timeout)
        self.model = model

    def describe(self) -> TeacherInfo:
        """The served model's version and context length; refuses a server that does not serve `model`."""
        served = {entry["id"]: entry for entry in self.get("/v1/models")["data"]}
        if self.model not in served:
            raise TeacherError(f"{self.shown} serves {sorted(served)}, not {self.model!r}")
        entry = served[self.model]
        version = str(entry.get("root") or self.model)
        try:
            reported = self.get("/weight_info").get("weight_version")
        except TeacherError:  # only served in vLLM's dev mode
            reported = None
        if reported not in (None, "default"):
            version = str(reported)
        return TeacherInfo(version=version, max_model_len=int(entry["max_model_len"]))

    def logprobs(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """The teacher's logprob of every token of each id sequence given those before it (position 0,
        which has none, gets 0)."""
        body = {
            "model": self.model,
            "prompt": [sequence.tolist() for sequence in sequences],
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0.0,
        }
        choices = sorted(self.post("/v1/completions", body)["choices"], key=lambda choice: choice["index"])
        if len(choices) != len(sequences):
            raise TeacherError(f"the teacher answered {len(choices)} prompts of {len(sequences)}")
        return [
            _prompt_logprobs(choice, sequence) for choice, sequence in zip(choices, sequences, strict=True)
        ]


def _prompt_logprobs(choice: dict[str, Any], sequence: np.ndarray) -> np.ndarray:
    entries = choice.get("prompt_logprobs")
    if entries is None or len(entries) != sequence.shape[0]:
        raise TeacherError("the teacher's reply has no prompt_logprobs for every token")
    values = np.zeros(sequence.shape[0], dtype=np.float32)
    for position in range(1, sequence.shape[0]):
        token = str(int(sequence[position]))
        if token not in entries[position]:
            raise TeacherError(f"the teacher's prompt_logprobs at position {position} omit token {token}")
        values[position] = entries[position][token]["logprob"]
    return values


def vocabulary_difference(policy: Server, teacher: Server) -> str | None:
    """Where the two servers' tokenizers first differ (every id decoded, special tokens included), or None
    when they decode every id alike. Ids past a vocabulary decode to nothing: the comparison ends where both
    do."""
    start = 0
    while True:
        ids = list(range(start, start + _VOCABULARY_CHUNK))
        ours, theirs = policy.decode(ids), teacher.decode(ids)
        if ours != theirs:
            low, high = 0, len(ids)  # the shortest prefix of the chunk that decodes differently
            while high - low > 1:
                middle = (low + high) // 2
                if policy.decode(ids[:middle]) == teacher.decode(ids[:middle]):
                    low = middle
                else:
                    high = middle
            token = ids[high - 1]
            return (
                f"token id {token} is {policy.decode([token])!r} for the policy, "
                f"{teacher.decode([token])!r} for the teacher"
            )
        if not ours:
            return None
        start += _VOCABULARY_CHUNK


@dataclass
class ScoreReport:
    turns: int = 0
    tokens: int = 0
    """Sampled tokens scored."""
    requests: int = 0
    sequence_tokens: int = 0
    """Tokens sent to the teacher (prompts and completions)."""
    too_long: list[tuple[str, int]] = field(default_factory=list)
    """(rollout, turn) left unscored: longer than the teacher's context."""
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.sequence_tokens / self.seconds if self.seconds else 0.0


@dataclass
class _Request:
    """One teacher call: sequences, and for each the turns whose completions it covers."""

    sequences: list[np.ndarray] = field(default_factory=list)
    turns: list[list[TurnToScore]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(int(s.shape[0]) for s in self.sequences)


def chains(turns: list[TurnToScore]) -> list[list[TurnToScore]]:
    """Turns (in order) grouped so that every turn's prompt + completion is a prefix of its group's last
    turn's: the last turn's sequence scores them all. A turn joins the latest group it extends, whatever
    other groups' turns came between (a sub-agent's calls inside a rollout)."""
    grouped: list[list[TurnToScore]] = []
    for turn in turns:
        chain = next((c for c in reversed(grouped) if _extends(turn, c[-1])), None)
        if chain is None:
            grouped.append([turn])
        else:
            chain.append(turn)
    return grouped


def _extends(turn: TurnToScore, previous: TurnToScore) -> bool:
    before = np.concatenate([previous.prompt_ids, previous.completion_ids])
    return turn.rollout_id == previous.rollout_id and bool(
        turn.prompt_ids.shape[0] >= before.shape[0]
        and np.array_equal(turn.prompt_ids[: before.shape[0]], before)
    )


class Scorer:
    """Scores a store's turns with one teacher, its scores stored under the teacher's model name."""

    def __init__(
        self, db: str, teacher: TeacherServer, *, batch_tokens: int = 16384, concurrency: int = 4
    ) -> None:
        self.teacher = teacher
        self.batch_tokens = batch_tokens
        self.concurrency = concurrency
        self._engine = make_engine(db)
        self._writer = make_engine(db, pool_size=1, writer=True)
        self._info: TeacherInfo | None = None

    def check(self, policy_url: str | None = None) -> TeacherInfo:
        """Refuse a teacher that does not serve its model or reads ids otherwise than the policy's server
        (`policy_url`; by default the server of the latest rollout)."""
        require_current_schema(self._engine)
        info = self.teacher.describe()
        policy_url = policy_url or _policy_server(self._engine)
        if policy_url is None:
            raise TeacherError("no rollout names its vLLM server: give the policy's server with --policy URL")
        policy = Server(policy_url)
        try:
            difference = vocabulary_difference(policy, self.teacher)
        finally:
            policy.close()
        if difference is not None:
            raise TeacherError(f"the teacher's tokenizer differs from the policy's: {difference}")
        self._info = info
        return info

    def score(
        self, where: ScoreFilter | None = None, on_progress: Callable[[int, int], None] | None = None
    ) -> ScoreReport:
        """Score every turn of the selected rollouts the teacher has not scored yet (`check` first).
        `on_progress(turns_done, turns_total)` follows the work."""
        if self._info is None:
            raise RuntimeError("Scorer.check() comes first")
        name, version = self.teacher.model, self._info.version
        with self._engine.connect() as conn:
            rollouts = rollouts_to_score(conn, name, where or ScoreFilter())
            total = _count_unscored(conn, name, rollouts)
        report = ScoreReport()
        started = time.monotonic()
        if on_progress:
            on_progress(0, total)

        def collect() -> None:
            done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in done:
                self._save(in_flight.pop(future), future.result(), version, report)
            if on_progress:
                on_progress(report.turns + len(report.too_long), total)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            in_flight: dict[Future[list[np.ndarray]], _Request] = {}
            for start in range(0, len(rollouts), _ROLLOUTS_PER_READ):
                with self._engine.connect() as conn:
                    turns = turns_to_score(conn, name, rollouts[start : start + _ROLLOUTS_PER_READ])
                for request in _requests(turns, self._info.max_model_len, self.batch_tokens, report):
                    while len(in_flight) >= self.concurrency:
                        collect()
                    in_flight[pool.submit(self.teacher.logprobs, request.sequences)] = request
            while in_flight:
                collect()
        report.seconds = time.monotonic() - started
        return report

    def _save(self, request: _Request, logprobs: list[np.ndarray], version: str, report: ScoreReport) -> None:
        """One request's scores, in one transaction: each turn's slice of its chain's sequence."""
        scores = []
        for sequence_logprobs, chain in zip(logprobs, request.turns, strict=True):
            for turn in chain:
                start = turn.prompt_ids.shape[0]
                scores.append((turn.turn_id, sequence_logprobs[start : start + turn.completion_ids.shape[0]]))
                report.tokens += int(turn.completion_ids.shape[0])
        with self._writer.begin() as conn:
            save_scores(conn, self.teacher.model, version, scores)
        report.turns += len(scores)
        report.requests += 1
        report.sequence_tokens += request.tokens

    def close(self) -> None:
        self._writer.dispose()
        self._engine.dispose()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _requests(
    turns: list[TurnToScore], max_model_len: int, batch_tokens: int, report: ScoreReport
) -> Iterator[_Request]:
    request = _Request()
    by_rollout: dict[str, list[TurnToScore]] = {}
    for turn in turns:
        by_rollout.setdefault(turn.rollout_id, []).append(turn)
    for rollout_turns in by_rollout.values():
        for chain in chains(rollout_turns):
            last = chain[-1]
            if last.tokens >= max_model_len:  # the teacher also samples one token
                report.too_long.extend((t.rollout_id, t.turn_index) for t in chain)
                continue
            if request.sequences and request.tokens + last.tokens > batch_tokens:
                yield request
                request = _Request()
            request.sequences.append(np.concatenate([last.prompt_ids, last.completion_ids]))
            request.turns.append(chain)
    if request.sequences:
        yield request


def _count_unscored(conn: Connection, teacher: str, rollouts: list[str]) -> int:
    t = schema.turns
    total = 0
    for start in range(0, len(rollouts), 1000):
        query = select(func.count()).where(
            t.c.rollout_id.in_(rollouts[start : start + 1000]), unscored(teacher)
        )
        total += int(conn.execute(query).scalar_one())
    return total


def _policy_server(engine: Engine) -> str | None:
    """The vLLM server the latest rollout was pinned to: it serves the policy's tokenizer."""
    r = schema.rollouts
    query = select(r.c.backend).where(r.c.backend.is_not(None)).order_by(r.c.created_at.desc()).limit(1)
    with engine.connect() as conn:
        backend: str | None = conn.execute(query).scalar_one_or_none()
    return backend

// A rollout: every turn in order, with what the harness sent and received, and the exact ids the engine saw
// and sampled, token by token.
"use strict";

const rolloutId = decodeURIComponent(location.pathname.split("/").pop());

function fact(name, value) {
  return value === null || value === undefined || value === "" ? null : el("span", {}, `${name} `, el("b", {}, value));
}

function token(id, text, sampled, logprob) {
  const shown = text === undefined ? `[${id}]` : text;
  const title = `id ${id} · ${JSON.stringify(text ?? null)}` + (sampled ? ` · logprob ${fixed(logprob, 4)}` : "");
  const span = el("span", { class: sampled ? "tok m1" : "tok m0", title, "data-id": id }, shown);
  if (sampled) span.style.setProperty("--confidence", (0.12 + 0.5 * Math.exp(logprob)).toFixed(3));
  return span;
}

function tokenView(turn, texts) {
  const view = el("div", { class: "tokens" });
  const boundary = turn.parent_turn !== null ? turn.prefix_tokens : null;
  turn.prompt_token_ids.forEach((id, i) => {
    if (i === boundary) {
      if (turn.drift_tokens > 0) view.append(el("span", { class: "marker drift", title: `${turn.drift_tokens} tokens differ from the parent's` }, "drift"));
      if (turn.splice) view.append(el("span", { class: "marker splice", title: turn.splice }, "splice"));
    }
    view.append(token(id, texts[id], false));
  });
  turn.completion_token_ids.forEach((id, i) => view.append(token(id, texts[id], true, turn.completion_logprobs[i])));
  return view;
}

function messagesView(turn) {
  const shown = (turn.messages || []).map((m) => el("div", { class: "message" }, el("span", { class: "role" }, `${m.role}: `),
    typeof m.content === "string" ? m.content : JSON.stringify(m.content ?? ""),
    m.tool_calls && m.tool_calls.length ? `\n${JSON.stringify(m.tool_calls)}` : ""));
  const reply = el("div", { class: "message" }, el("span", { class: "role" }, "reply: "),
    turn.reasoning ? `[reasoning] ${turn.reasoning}\n` : "", turn.content ?? "",
    turn.tool_calls && turn.tool_calls.length ? `\n${JSON.stringify(turn.tool_calls)}` : "");
  return [el("details", {}, el("summary", {}, `${shown.length} messages sent`), ...shown), reply];
}

function turnView(turn, texts) {
  const facts = [
    fact("status", turn.status), fact("endpoint", turn.endpoint), fact("model", turn.model), fact("backend", turn.backend),
    fact("policy version", turn.policy_version === turn.policy_version_end ? turn.policy_version : `${turn.policy_version} → ${turn.policy_version_end}`),
    fact("parent", turn.parent_turn), fact("forked from", turn.forked_from), fact("moved off", turn.repinned_from),
    fact("prompt", `${turn.prompt_tokens} tokens`), fact("completion", `${turn.completion_tokens} tokens`),
    fact("finish", turn.finish_reason), fact("latency", `${fixed(turn.latency_s, 2)} s`),
    fact("first token", turn.first_token_at ? `${fixed(turn.first_token_at - turn.started_at, 2)} s` : null),
    fact("retry of", turn.retry_of), fact("choice", turn.choice_index || null),
  ].filter(Boolean);
  const markers = [];
  if (turn.forked_from !== null) markers.push(el("span", { class: "marker fork" }, `fork of turn ${turn.forked_from}`));
  if (turn.drift_tokens > 0) markers.push(el("span", { class: "marker drift" }, `drift ${turn.drift_tokens}`));
  return el("li", { class: "turn", id: `turn-${turn.index}`, "data-status": turn.status },
    el("h3", {}, `turn ${turn.index} `, ...markers),
    el("div", { class: "facts" }, ...facts),
    turn.error ? el("p", { class: "error" }, turn.error) : "",
    ...messagesView(turn),
    el("details", { open: "" }, el("summary", {}, `tokens: ${turn.prompt_token_ids.length} prompt, ${turn.completion_token_ids.length} sampled`),
      tokenView(turn, texts)));
}

async function show() {
  document.getElementById("title").textContent = rolloutId;
  let data;
  try {
    data = await readJson(`/ui/api/rollouts/${encodeURIComponent(rolloutId)}`);
  } catch (error) {
    document.getElementById("summary").append(el("p", { class: "error" }, String(error)));
    return;
  }
  const r = data.rollout;
  document.getElementById("summary").append(el("div", { class: "facts" },
    ...[fact("status", r.status), fact("reward", fixed(r.reward)), fact("group", r.group_id), fact("task", r.task_id),
      fact("mode", r.mode), fact("turns", r.turns.length), fact("end", r.end_reason)].filter(Boolean)));
  document.getElementById("turns").replaceChildren(...r.turns.map((turn) => turnView(turn, data.texts[String(turn.model)] || {})));
}

show();

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

// Why a chain starts where it does, from its first turn's lineage.
function chainStart(turn, turns) {
  if (turns.some((other) => other.retry_of === turn.index)) return "an attempt the client retried";
  if (turn.parent_turn === null) {
    return turn.forked_from !== null ? `a restart from turn ${turn.forked_from}'s history (a compaction or an edit)`
      : turn.index === 0 ? "the conversation" : "a new conversation (a sub-agent's, or a new task)";
  }
  if (turn.drift_tokens > 0) return `turn ${turn.parent_turn}'s tokens, re-rendered (${turn.drift_tokens} differ)`;
  return `a branch of turn ${turn.parent_turn} (an earlier turn went on from it)`;
}

// The lineage tree as the trainer sees it: one lane per chain of turns that trains as one merged sample
// (`samples`), each turn on its chain's lane, edges to the turn it extends (dashed: to the turn whose history
// it rewrote); turns that sampled nothing sit on lanes of their own below.
function lineage(turns, samples) {
  const box = document.getElementById("lineage");
  const lane = new Map(), byIndex = new Map(turns.map((turn) => [turn.index, turn]));
  samples.forEach((sample, chain) => sample.turn_indices.forEach((index) => lane.set(index, chain)));
  let lanes = samples.length;
  for (const turn of turns) if (!lane.has(turn.index)) lane.set(turn.index, lanes++);
  const step = 34, x = (index) => 20 + index * step, y = (index) => 18 + lane.get(index) * 26;
  const nodes = [];
  for (const turn of turns) {
    for (const [from, dashed] of [[turn.parent_turn, false], [turn.forked_from, true]]) {
      if (from === null || !lane.has(from) || (dashed && from === turn.parent_turn)) continue;
      nodes.push(svg("line", { x1: x(from), y1: y(from), x2: x(turn.index), y2: y(turn.index), class: dashed ? "edge fork" : "edge",
        stroke: dashed ? "#d2691e" : "#9aa3b5", "stroke-dasharray": dashed ? "4 3" : "none" }));
    }
  }
  for (const turn of turns) {
    const kind = turn.status !== "ok" ? "error" : turn.forked_from !== null ? "fork" : "ok";
    const node = svg("circle", { cx: x(turn.index), cy: y(turn.index), r: 7, class: `node ${kind}`, "data-turn": turn.index,
      "data-chain": lane.get(turn.index) < samples.length ? lane.get(turn.index) : "",
      fill: { ok: "#2364d2", fork: "#d2691e", error: "#c0392b" }[kind],
      stroke: turn.drift_tokens > 0 ? "#c0392b" : "#fff", "stroke-width": turn.drift_tokens > 0 ? 3 : 1 });
    node.append(svg("title", {}, `turn ${turn.index}` + (turn.parent_turn !== null ? ` · extends turn ${turn.parent_turn}` : "") +
      (turn.drift_tokens > 0 ? ` · drift ${turn.drift_tokens}` : "")));
    node.addEventListener("click", () => { location.hash = `turn-${turn.index}`; });
    nodes.push(node, svg("text", { x: x(turn.index) - 4, y: y(turn.index) + 20 }, turn.index));
  }
  const right = 40 + Math.max(turns.length - 1, 0) * step;
  samples.forEach((sample, chain) => {
    const trained = sample.loss_mask.filter((m) => m === 1).length;
    const start = chainStart(byIndex.get(sample.turn_indices[0]), turns);
    nodes.push(svg("text", { x: right, y: 22 + chain * 26, class: "lane", "data-chain": chain },
      `chain ${chain + 1}: turns ${sample.turn_indices.join(", ")} · ${trained} tokens trained · starts: ${start}`));
  });
  box.setAttribute("width", right + 640);
  box.setAttribute("height", 30 + lanes * 26);
  box.replaceChildren(...nodes);
}

function sampleView(sample, texts) {
  const view = lazy(el("div", { class: "tokens" }),
    () => sample.input_ids.map((id, i) => token(id, texts[id], sample.loss_mask[i] === 1, sample.logprobs[i])));
  const trained = sample.loss_mask.filter((m) => m === 1).length;
  return el("div", { class: "sample" },
    el("div", { class: "facts" }, ...[fact("turns", sample.turn_indices.join(", ")), fact("tokens", sample.input_ids.length),
      fact("trained (mask 1)", trained), fact("advantage", fixed(sample.advantage)), fact("policy version", sample.policy_version),
      fact("masked", sample.masked ? "yes" : null)].filter(Boolean)),
    view);
}

function showSamples(rollout, texts, data) {
  const box = document.getElementById("samples");
  const models = new Map(rollout.turns.map((turn) => [turn.index, String(turn.model)]));
  const verdict = data.skip_reason ? `not trained now: ${data.skip_reason}`
    : data.advantage === null ? "each choice rewarded on its own trains with its own advantage"
    : `trained with advantage ${fixed(data.advantage)}, shared by every chain`;
  box.replaceChildren(el("p", { class: data.skip_reason ? "bad" : "" }, `${data.samples.length} merged samples (one per chain); ${verdict}`),
    ...data.samples.map((sample) => sampleView(sample, texts[models.get(sample.turn_indices[0])] || {})));
}

function tokenView(turn, texts) {
  // A turn that extends its parent shows the tokens it shares with it folded, then what is new.
  const boundary = turn.parent_turn !== null ? turn.prefix_tokens : 0;
  const ids = turn.prompt_token_ids;
  return lazy(el("div", { class: "tokens" }), () => {
    const shown = [];
    if (boundary > 0) {
      const shared = el("details", { class: "prefix" }, el("summary", {}, `⋯ ${boundary} tokens as in turn ${turn.parent_turn}`));
      shared.addEventListener("toggle", () => shared.append(...ids.slice(0, boundary).map((id) => token(id, texts[id], false))), { once: true });
      shown.push(shared);
      if (turn.drift_tokens > 0) shown.push(el("span", { class: "marker drift", title: `${turn.drift_tokens} tokens differ from the parent's` }, "drift"));
      if (turn.splice) shown.push(el("span", { class: "marker splice", title: turn.splice }, "splice"));
    }
    ids.slice(boundary).forEach((id) => shown.push(token(id, texts[id], false)));
    // Where another weight version took over inside the reply (a keep-mode update): a marker before its first token.
    const takesOver = new Map((turn.weight_versions || []).filter((span) => span.start > 0).map((span) => [span.start, span.version]));
    turn.completion_token_ids.forEach((id, i) => {
      if (takesOver.has(i)) shown.push(el("span", { class: "marker version", title: `sampled by weight version ${takesOver.get(i)} from here` }, `version ${takesOver.get(i)}`));
      shown.push(token(id, texts[id], true, turn.completion_logprobs[i]));
    });
    return shown;
  });
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
    fact("adapter", turn.adapter),
    fact("weight versions", turn.weight_versions && turn.weight_versions.length > 1
      ? turn.weight_versions.map((span) => `${span.version}: tokens ${span.start}–${span.end}`).join(", ") : null),
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
  const group = el("span", {}, "group ", el("a", { href: `/ui/groups/${encodeURIComponent(r.group_id)}` }, r.group_id));
  document.getElementById("summary").append(el("div", { class: "facts" },
    ...[fact("status", r.status), fact("reward", fixed(r.reward)), group, fact("policy", r.policy), fact("task", r.task_id),
      fact("mode", r.mode), fact("turns", r.turns.length), fact("end", r.end_reason)].filter(Boolean)));
  document.getElementById("turns").replaceChildren(...r.turns.map((turn) => turnView(turn, data.texts[String(turn.model)] || {})));
  let samples;
  try {
    samples = await readJson(`/ui/api/rollouts/${encodeURIComponent(rolloutId)}/samples`);
  } catch (error) {
    lineage(r.turns, []);
    document.getElementById("samples").replaceChildren(el("p", { class: "error" }, String(error)));
    return;
  }
  lineage(r.turns, samples.samples);
  document.getElementById("training").addEventListener("toggle", () => showSamples(r, data.texts, samples), { once: true });
}

show();

// A GRPO group: its rollouts side by side, with rewards and the advantages a trainer would give them.
"use strict";

const groupId = decodeURIComponent(location.pathname.split("/").pop());

function bars(rollouts) {
  const box = document.getElementById("advantages");
  const width = Number(box.getAttribute("width")), height = Number(box.getAttribute("height"));
  const scored = rollouts.filter((r) => r.advantage !== null);
  if (!scored.length) {
    const why = rollouts.some((r) => r.choices.length) ? "each choice trains with its own advantage: see the table"
      : "no rollout of this group trains yet";
    box.replaceChildren(svg("text", { x: 10, y: height / 2 }, why));
    return;
  }
  const reach = Math.max(...scored.map((r) => Math.abs(r.advantage)), 1e-9);
  const middle = height / 2, slot = (width - 20) / rollouts.length;
  const nodes = [svg("line", { x1: 10, y1: middle, x2: width - 10, y2: middle, stroke: "#d8dde6" })];
  rollouts.forEach((r, i) => {
    if (r.advantage === null) return;
    const size = (Math.abs(r.advantage) / reach) * (middle - 14);
    const top = r.advantage >= 0 ? middle - size : middle;
    nodes.push(svg("rect", { x: 10 + i * slot + slot * 0.15, y: top, width: slot * 0.7, height: Math.max(size, 1),
      fill: r.advantage >= 0 ? "#2364d2" : "#c0392b", class: "advantage", "data-rollout": r.rollout_id },
    `${r.rollout_id}: ${fixed(r.advantage)}`));
    nodes.push(svg("text", { x: 10 + i * slot + slot * 0.15, y: r.advantage >= 0 ? top - 3 : top + size + 11 },
      fixed(r.advantage, 2)));
  });
  box.replaceChildren(...nodes);
}

// Choices of a call rewarded one by one: each trains with its own advantage, across its call's choices.
function choices(r) {
  if (!r.choices.length) return [];
  return [el("div", { class: "choices", title: "advantages of the choices rewarded one by one, by turn" },
    r.choices.map((c) => `${c.turn_index}: ${fixed(c.advantage, 2)}`).join("  "))];
}

function table(rollouts) {
  const head = ["rollout", "status", "reward", "advantage", "trains", "turns", "tokens", "errors", "drifted",
    "version", "last reply"];
  const rows = [el("tr", {}, ...head.map((name) => el("th", {}, name)))];
  for (const r of rollouts) {
    const trains = r.skip_reason ? `no: ${r.skip_reason}` : r.masked ? "masked" : "yes";
    rows.push(el("tr", { "data-rollout": r.rollout_id },
      el("td", {}, el("a", { href: `/ui/rollouts/${encodeURIComponent(r.rollout_id)}` }, r.rollout_id)),
      el("td", { class: `status-${r.status}` }, r.status),
      el("td", { class: "num reward" }, fixed(r.reward)),
      el("td", { class: "num advantage" }, fixed(r.advantage), ...choices(r)),
      el("td", { class: r.skip_reason ? "bad" : "" }, trains),
      el("td", { class: "num" }, r.turns),
      el("td", { class: "num" }, r.prompt_tokens + r.completion_tokens),
      el("td", { class: r.errors ? "num bad" : "num" }, r.errors),
      el("td", { class: r.drifted ? "num bad" : "num" }, r.drifted),
      el("td", {}, r.policy_version ?? ""),
      el("td", { class: "reply", title: r.last_reply ?? "" }, (r.last_reply ?? "").slice(0, 120))));
  }
  document.getElementById("rollouts").replaceChildren(...rows);
}

async function show() {
  document.getElementById("title").textContent = groupId;
  let data;
  try {
    data = await readJson(`/ui/api/groups/${encodeURIComponent(groupId)}`);
  } catch (error) {
    document.getElementById("summary").append(el("p", { class: "error" }, String(error)));
    return;
  }
  document.getElementById("scaling").textContent = data.normalized ? "divided by the group's reward std (GRPO)" : "not scaled";
  document.getElementById("summary").append(el("div", { class: "facts" },
    el("span", {}, "rollouts ", el("b", {}, data.rollouts.length)), el("span", {}, "trained ", el("b", {}, data.trained)),
    el("span", {}, "mean reward of the trained ", el("b", {}, fixed(data.reward_mean)))));
  if (data.waiting) {
    const w = data.waiting;
    document.getElementById("summary").append(el("p", { class: "waiting" },
      `Declared with ${data.group_size} members: ${w.created} created, ${w.finished} finished, waiting for ` +
      `${Math.round(w.age_s)} s. A trainer takes it once all ${data.group_size} have finished (or at its group ` +
      "timeout, with the members it has): the advantages below are those of the members so far."));
  }
  bars(data.rollouts);
  table(data.rollouts);
}

show();

// The overview: rollouts by group, newest first, with the reward per policy version; it follows the store
// (read again every few seconds while the page is visible).
"use strict";

const REFRESH_MS = 3000;

function filters() {
  const params = new URLSearchParams();
  for (const [key, value] of new FormData(document.getElementById("filters"))) if (value) params.set(key, value);
  return params;
}

function renderRollouts(rollouts) {
  const table = document.getElementById("rollouts");
  const head = ["rollout", "status", "reward", "version", "turns", "prompt tok", "completion tok", "errors",
    "drifted", "forks", "tags", "created", "finished"];
  const rows = [el("tr", {}, ...head.map((name) => el("th", {}, name)))];
  const groups = new Map();
  for (const rollout of rollouts) {
    if (!groups.has(rollout.group_id)) groups.set(rollout.group_id, []);
    groups.get(rollout.group_id).push(rollout);
  }
  for (const [group, members] of groups) {
    const rewards = members.map((r) => r.reward).filter((r) => r !== null);
    const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
    const link = el("a", { href: `/ui/groups/${encodeURIComponent(group)}` }, `group ${group}`);
    rows.push(el("tr", { class: "group" },
      el("td", { colspan: 2 }, link), el("td", { class: "num" }, fixed(mean)), el("td", { colspan: head.length - 3 },
        members[0].group_size ? `${members.length} of ${members[0].group_size} rollouts` : `${members.length} rollouts`)));
    for (const r of members) {
      rows.push(el("tr", { "data-rollout": r.rollout_id },
        el("td", {}, el("a", { href: `/ui/rollouts/${encodeURIComponent(r.rollout_id)}` }, r.rollout_id)),
        el("td", { class: `status-${r.status}` }, r.status),
        el("td", { class: "num reward" }, fixed(r.reward)),
        el("td", {}, r.policy_version ?? ""),
        el("td", { class: "num" }, r.turns),
        el("td", { class: "num" }, r.prompt_tokens),
        el("td", { class: "num" }, r.completion_tokens),
        el("td", { class: r.errors ? "num bad" : "num" }, r.errors),
        el("td", { class: r.drifted ? "num bad" : "num" }, r.drifted),
        el("td", { class: "num" }, r.forks),
        el("td", {}, (r.tags || []).join(", ")),
        el("td", {}, when(r.created_at)),
        el("td", {}, when(r.finished_at))));
    }
  }
  table.replaceChildren(...rows);
  document.getElementById("count").textContent = `${rollouts.length} shown, newest first`;
}

function renderVersions(versions) {
  const series = { training: versions.training, evaluation: versions.evaluation };
  const table = document.getElementById("versions");
  const rows = [el("tr", {}, ...["rollouts of", "policy version", "rollouts", "failed", "tasks", "mean reward",
    "pass@1"].map((name) => el("th", {}, name)))];
  for (const [kind, points] of Object.entries(series)) {
    for (const p of points) {
      rows.push(el("tr", {}, el("td", {}, kind), el("td", {}, p.policy_version ?? ""), el("td", { class: "num" }, p.rollouts),
        el("td", { class: "num" }, p.failed), el("td", { class: "num" }, p.tasks),
        el("td", { class: "num" }, fixed(p.reward_mean)), el("td", { class: "num" }, fixed(p["pass@1"]))));
    }
  }
  table.replaceChildren(...rows);
  plot(series);
}

function plot(series) {
  const box = document.getElementById("plot");
  const width = Number(box.getAttribute("width")), height = Number(box.getAttribute("height"));
  const pad = { left: 44, right: 130, top: 10, bottom: 28 };
  const labels = [...new Set(Object.values(series).flat().map((p) => p.policy_version ?? ""))];
  const values = Object.values(series).flat().map((p) => p.reward_mean).filter((v) => v !== null);
  const nodes = [];
  if (!values.length) {
    nodes.push(svg("text", { x: pad.left, y: height / 2 }, "no finished rollout with a reward yet"));
    box.replaceChildren(...nodes);
    return;
  }
  let low = Math.min(...values, 0), high = Math.max(...values, 1);
  if (high === low) high = low + 1;
  const x = (label) => pad.left + (labels.length === 1 ? 0.5 : labels.indexOf(label) / (labels.length - 1)) *
    (width - pad.left - pad.right);
  const y = (value) => height - pad.bottom - ((value - low) / (high - low)) * (height - pad.top - pad.bottom);
  nodes.push(svg("line", { x1: pad.left, y1: y(low), x2: width - pad.right, y2: y(low), stroke: "#d8dde6" }));
  for (const value of [low, (low + high) / 2, high]) {
    nodes.push(svg("text", { x: 4, y: y(value) + 4 }, value.toFixed(2)));
  }
  labels.forEach((label) => nodes.push(svg("text", { x: x(label) - 4, y: height - 8 }, label)));
  const colours = { training: "#2364d2", evaluation: "#d2691e" };
  Object.entries(series).forEach(([kind, points], row) => {
    const scored = points.filter((p) => p.reward_mean !== null);
    if (!scored.length) return;
    const path = scored.map((p, i) => `${i ? "L" : "M"}${x(p.policy_version ?? "")},${y(p.reward_mean)}`).join(" ");
    nodes.push(svg("path", { d: path, fill: "none", stroke: colours[kind], "stroke-width": 2, class: `series-${kind}` }));
    for (const p of scored) {
      nodes.push(svg("circle", { cx: x(p.policy_version ?? ""), cy: y(p.reward_mean), r: 3, fill: colours[kind] }));
    }
    nodes.push(svg("text", { x: width - pad.right + 10, y: pad.top + 14 + row * 16, fill: colours[kind] },
      `${kind} reward`));
  });
  box.replaceChildren(...nodes);
}

async function refresh() {
  const answer = await fetch(`/ui/api/rollouts?${filters()}`, { credentials: "same-origin" });
  const live = document.getElementById("live");
  if (!answer.ok) {
    live.textContent = `could not read the store (HTTP ${answer.status})`;
    return;
  }
  const data = await answer.json();
  renderRollouts(data.rollouts);
  renderVersions(data.versions);
  live.textContent = `live, read at ${new Date().toLocaleTimeString()}`;
}

document.getElementById("filters").addEventListener("submit", (event) => {
  event.preventDefault();
  history.replaceState(null, "", `?${filters()}`);
  refresh();
});
for (const [key, value] of new URLSearchParams(location.search)) {
  const field = document.querySelector(`#filters [name="${key}"]`);
  if (field) field.value = value;
}
refresh();
setInterval(() => { if (!document.hidden) refresh(); }, REFRESH_MS);

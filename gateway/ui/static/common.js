// Helpers every viewer page uses.
"use strict";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

const fixed = (value, digits = 3) => (value === null || value === undefined ? "" : Number(value).toFixed(digits));
const when = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleTimeString() : "");

async function readJson(url) {
  const answer = await fetch(url, { credentials: "same-origin" });
  if (!answer.ok) throw new Error(`HTTP ${answer.status}: ${(await answer.text()).slice(0, 200)}`);
  return answer.json();
}

// Fill `box` with `render()` once it comes near the screen: a long rollout's pages hold far more tokens than
// a browser lays out quickly, and most are never scrolled to.
const nearScreen = new IntersectionObserver((entries) => {
  for (const entry of entries) {
    if (!entry.isIntersecting) continue;
    nearScreen.unobserve(entry.target);
    entry.target.replaceChildren(...entry.target.render());
  }
}, { rootMargin: "1500px 0px" });

function lazy(box, render) {
  box.render = render;
  nearScreen.observe(box);
  return box;
}

// Validates mermaid diagrams with mermaid's own parser under Node.
// Usage: node validate.mjs FILE...   (FILE may be .md with ```mermaid blocks, or raw .mmd)
// Prints one line per diagram: "ok <file>#<n>" or "error <file>#<n>: <message>"; exit 1 on any error.
import { readFileSync } from "node:fs";
import { JSDOM } from "jsdom";

const dom = new JSDOM("<!DOCTYPE html><html><body></body></html>", { pretendToBeVisual: true });
globalThis.window = dom.window;
globalThis.document = dom.window.document;
for (const key of ["navigator", "Element", "HTMLElement", "SVGElement", "DOMParser"]) {
  if (!(key in globalThis)) {
    try { globalThis[key] = dom.window[key]; } catch { /* read-only in this Node */ }
  }
}
const { default: mermaid } = await import("mermaid");
mermaid.initialize({ startOnLoad: false });

function blocks(file) {
  const text = readFileSync(file, "utf8");
  if (!file.endsWith(".md")) return [text];
  const out = [];
  const re = /```mermaid\n([\s\S]*?)```/g;
  let m;
  while ((m = re.exec(text)) !== null) out.push(m[1]);
  return out;
}

let failed = 0;
for (const file of process.argv.slice(2)) {
  const found = blocks(file);
  if (found.length === 0) {
    console.log(`error ${file}#0: no mermaid block found`);
    failed++;
    continue;
  }
  for (const [i, src] of found.entries()) {
    try {
      await mermaid.parse(src);
      console.log(`ok ${file}#${i}`);
    } catch (err) {
      const msg = String(err && err.message ? err.message : err).split("\n").slice(0, 4).join(" | ");
      console.log(`error ${file}#${i}: ${msg}`);
      failed++;
    }
  }
}
process.exit(failed ? 1 : 0);

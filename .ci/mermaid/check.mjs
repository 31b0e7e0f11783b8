// Parses each ```mermaid block of the Markdown files named on the command line with mermaid's own parser (in jsdom),
// and prints one line per block: "ok FILE #N" or "FAIL FILE #N: the parser's message". Exits 1 if any failed.
import fs from "fs";
import { JSDOM } from "jsdom";

const dom = new JSDOM("<!DOCTYPE html><body></body>");
globalThis.window = dom.window;
globalThis.document = dom.window.document;
const { default: mermaid } = await import("mermaid");
mermaid.initialize({ startOnLoad: false });
let failed = 0;
for (const file of process.argv.slice(2)) {
  const blocks = [...fs.readFileSync(file, "utf8").matchAll(/^```mermaid\n([\s\S]*?)^```/gm)].map((m) => m[1]);
  for (const [index, block] of blocks.entries()) {
    try {
      await mermaid.parse(block);
      console.log(`ok ${file} #${index}`);
    } catch (error) {
      failed += 1;
      console.log(`FAIL ${file} #${index}: ${String(error.message || error).split("\n").join(" ")}`);
    }
  }
}
process.exit(failed ? 1 : 0);

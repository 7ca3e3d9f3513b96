// Renders chat templates with @huggingface/jinja (the engine transformers.js
// uses), the reference for //common/chat:jinja_test.
//   node render_reference.mjs <node_modules> <cases.json>
// cases.json: [{"template": str, "context": {...}}, ...]. Prints a JSON
// array with one {"output": str} or {"error": str} per case.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const [nodeModules, casesPath] = process.argv.slice(2);
const { Template } = await import(
  pathToFileURL(path.join(nodeModules, "@huggingface/jinja/dist/index.js")).href
);
const cases = JSON.parse(readFileSync(casesPath, "utf8"));
const compiled = new Map();
const results = cases.map(({ template, context }) => {
  try {
    if (!compiled.has(template)) compiled.set(template, new Template(template));
    return { output: compiled.get(template).render(context) };
  } catch (e) {
    return { error: String(e && e.message ? e.message : e) };
  }
});
process.stdout.write(JSON.stringify(results));

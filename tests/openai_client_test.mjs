// The official OpenAI Node client (npm `openai`, pinned in third_party/npm)
// against the router's HTTP API; driven by tests/openai_client_test.py,
// which starts the stack.
//   node tests/openai_client_test.mjs <node_modules> <base_url> <api_key>
// Exits non-zero on the first failed check; prints one line per check.
import assert from "node:assert/strict";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [nodeModules, baseURL, apiKey] = process.argv.slice(2);
const { default: OpenAI } = await import(
  pathToFileURL(path.join(nodeModules, "openai/index.mjs")).href
);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });

const STORY =
  "Once upon a time, there was a little girl named Lily. She loved to play " +
  "outside with her dog Max. One day, they found a big red ball in the park. " +
  "Lily was very happy and she wanted to share it with her friends.";
const MESSAGES = [
  { role: "system", content: "You tell short stories." },
  { role: "user", content: "Tell me about Lily and her dog." },
];

async function check(name, fn) {
  await fn();
  console.log(`ok ${name}`);
}

// Collects a stream: text, finish reasons, usage and specserve stats.
async function collect(stream, chat) {
  let text = "";
  const finishes = [];
  let usage = null;
  let stats = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    if (chunk.specserve) stats = chunk.specserve;
    for (const c of chunk.choices) {
      text += chat ? (c.delta.content ?? "") : c.text;
      if (c.finish_reason) finishes.push(c.finish_reason);
    }
  }
  return { text, finishes, usage, stats, chunks };
}

const models = await client.models.list();
const model = models.data[0].id;
await check("models.list", async () => {
  assert.equal(models.data.length, 1);
  assert.equal(model, "stories260K");
});

let greedy;
await check("completions (unary, usage, specserve stats)", async () => {
  greedy = await client.completions.create({
    model, prompt: STORY, max_tokens: 32, temperature: 0,
    speculative_prefill: { enabled: true, keep_ratio: 0.3, chunk_size: 8 },
    speculative_decoding: { enabled: true, num_draft_tokens: 4 },
  });
  assert.equal(greedy.object, "text_completion");
  assert.equal(greedy.choices.length, 1);
  const c = greedy.choices[0];
  assert.ok(c.text.length > 0);
  assert.ok(["stop", "length"].includes(c.finish_reason));
  assert.ok(greedy.usage.prompt_tokens > 40);
  assert.ok(greedy.usage.completion_tokens > 0);
  assert.ok(greedy.usage.completion_tokens <= 32);
  assert.equal(greedy.usage.total_tokens,
               greedy.usage.prompt_tokens + greedy.usage.completion_tokens);
  // The extensions reached the router: 30% of the 8-token chunks kept.
  assert.ok(greedy.specserve.kept_prompt_tokens < greedy.usage.prompt_tokens);
  assert.ok(greedy.specserve.num_drafts > 0);
});

await check("completions stream == unary (include_usage)", async () => {
  const s = await client.completions.create({
    model, prompt: STORY, max_tokens: 32, temperature: 0, stream: true,
    stream_options: { include_usage: true },
    speculative_prefill: { enabled: true, keep_ratio: 0.3, chunk_size: 8 },
    speculative_decoding: { enabled: true, num_draft_tokens: 4 },
  });
  const r = await collect(s, false);
  assert.equal(r.text, greedy.choices[0].text);
  assert.deepEqual(r.finishes, [greedy.choices[0].finish_reason]);
  assert.deepEqual(r.usage, greedy.usage);
  assert.equal(r.stats.kept_prompt_tokens, greedy.specserve.kept_prompt_tokens);
  assert.ok(r.chunks >= 3);
});

let chat;
await check("chat.completions (unary)", async () => {
  chat = await client.chat.completions.create({
    model, messages: MESSAGES, max_tokens: 24, temperature: 0,
  });
  assert.equal(chat.object, "chat.completion");
  const m = chat.choices[0].message;
  assert.equal(m.role, "assistant");
  assert.ok(m.content.length > 0);
  assert.ok(chat.usage.completion_tokens > 0);
});

await check("chat.completions stream == unary", async () => {
  const s = await client.chat.completions.create({
    model, messages: MESSAGES, max_tokens: 24, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  const r = await collect(s, true);
  assert.equal(r.text, chat.choices[0].message.content);
  assert.deepEqual(r.finishes, [chat.choices[0].finish_reason]);
  assert.deepEqual(r.usage, chat.usage);
});

await check("stop strings", async () => {
  const text = greedy.choices[0].text;
  const at = text.indexOf(" ", Math.floor(text.length / 2));
  assert.ok(at > 0, text);
  const stop = text.slice(at, at + 4);
  for (const stream of [false, true]) {
    const req = {
      model, prompt: STORY, max_tokens: 32, temperature: 0, stop: [stop],
      speculative_prefill: { enabled: true, keep_ratio: 0.3, chunk_size: 8 },
    };
    let got, finish;
    if (stream) {
      const r = await collect(
          await client.completions.create({ ...req, stream: true }), false);
      got = r.text;
      finish = r.finishes[0];
    } else {
      const r = await client.completions.create(req);
      got = r.choices[0].text;
      finish = r.choices[0].finish_reason;
    }
    assert.equal(got, text.slice(0, text.indexOf(stop)));
    assert.equal(finish, "stop");
  }
});

await check("seed reproducibility", async () => {
  const run = async (seed) =>
    (await client.completions.create({
      model, prompt: "Once upon a time", max_tokens: 40, temperature: 1.0,
      top_p: 0.95, seed,
    })).choices[0].text;
  const a = await run(7), b = await run(7);
  assert.equal(a, b);
  const others = [await run(8), await run(9), await run(10)];
  assert.ok(others.some((o) => o !== a), "different seeds, same text");
});

await check("penalties (OpenAI's presence / frequency, vLLM's repetition)", async () => {
  const req = {
    model, prompt: STORY, max_tokens: 32, temperature: 0,
    speculative_prefill: { enabled: true, keep_ratio: 0.3, chunk_size: 8 },
    speculative_decoding: { enabled: true, num_draft_tokens: 4 },
  };
  const plain = (await client.completions.create(req)).choices[0].text;
  const penalized = (await client.completions.create({
    ...req, presence_penalty: 1.5, frequency_penalty: 1.0,
    repetition_penalty: 1.3,
  })).choices[0].text;
  assert.notEqual(penalized, plain);
  await assert.rejects(
      client.completions.create({ model, prompt: "x", presence_penalty: 3 }),
      (e) => e instanceof OpenAI.BadRequestError &&
             e.param === "presence_penalty");
});

await check("logit_bias and min_tokens", async () => {
  const req = { model, prompt: STORY, max_tokens: 12, temperature: 0 };
  const plain = await client.completions.create({ ...req, logprobs: 0 });
  const forced = await client.completions.create({
    ...req, logprobs: 0, logit_bias: { "400": 100 },
  });
  const tokens = forced.choices[0].logprobs.tokens;
  assert.equal(tokens.length, 12);
  assert.ok(tokens.every((t) => t === tokens[0]), JSON.stringify(tokens));
  assert.notDeepEqual(tokens, plain.choices[0].logprobs.tokens);
  // A stop string early in the text is not looked for in the first
  // min_tokens tokens.
  const stopped = await client.completions.create({
    model, prompt: STORY, max_tokens: 30, temperature: 0, stop: ["."],
  });
  assert.equal(stopped.choices[0].finish_reason, "stop");
  assert.ok(stopped.usage.completion_tokens < 30);
  const long = await client.completions.create({
    model, prompt: STORY, max_tokens: 30, temperature: 0, stop: ["."],
    min_tokens: 30,
  });
  assert.equal(long.usage.completion_tokens, 30);
  assert.ok(long.choices[0].text.includes("."), long.choices[0].text);
  await assert.rejects(
      client.completions.create({ model, prompt: "x", logit_bias: { "1": 200 } }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "logit_bias");
});

await check("response_format json_object (JSON mode)", async () => {
  // The story model writes an object (unclosed within max_tokens: it
  // would fill strings forever); it starts with "{" and has no text
  // outside JSON. A schema is refused, not ignored.
  const r = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Tell me a story." }],
    max_tokens: 16, temperature: 0, response_format: { type: "json_object" },
  });
  const content = r.choices[0].message.content;
  assert.ok(content.trimStart().startsWith("{"), content);
  const plain = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Tell me a story." }],
    max_tokens: 16, temperature: 0,
  });
  assert.ok(!plain.choices[0].message.content.trimStart().startsWith("{"));
});

// A schema whose values are all bounded: the answer closes and is an
// instance, properties in the schema's order.
const PET = {
  type: "object",
  properties: {
    pet: { enum: ["cat", "dog"] },
    name: { type: "string", maxLength: 6 },
    happy: { type: "boolean" },
  },
  required: ["pet", "name", "happy"],
};

await check("response_format json_schema (structured output)", async () => {
  const r = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Tell me a story." }],
    max_tokens: 200, temperature: 0,
    response_format: {
      type: "json_schema", json_schema: { name: "pet", strict: true, schema: PET },
    },
  });
  assert.equal(r.choices[0].finish_reason, "stop");
  const v = JSON.parse(r.choices[0].message.content);
  assert.deepEqual(Object.keys(v), ["pet", "name", "happy"]);
  assert.ok(["cat", "dog"].includes(v.pet));
  assert.equal(typeof v.happy, "boolean");
  await assert.rejects(
      client.chat.completions.create({
        model, messages: [{ role: "user", content: "x" }],
        response_format: {
          type: "json_schema",
          json_schema: {
            name: "s",
            schema: { type: "object", properties: { a: { type: "string", pattern: "^a" } } },
          },
        },
      }),
      (e) => e instanceof OpenAI.BadRequestError &&
             e.param === "response_format" && /pattern/.test(e.message));
});

await check("tool_choice naming a function (unary and stream)", async () => {
  const req = {
    model, messages: [{ role: "user", content: "Pick a pet." }],
    max_tokens: 200, temperature: 0,
    tools: [{ type: "function", function: { name: "pick_pet", parameters: PET } }],
    tool_choice: { type: "function", function: { name: "pick_pet" } },
  };
  const r = await client.chat.completions.create(req);
  const call = r.choices[0].message.tool_calls[0];
  assert.equal(call.type, "function");
  assert.equal(call.function.name, "pick_pet");
  const args = JSON.parse(call.function.arguments);
  assert.ok(["cat", "dog"].includes(args.pet));
  let streamed = "";
  for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
    for (const ch of chunk.choices) {
      for (const t of ch.delta.tool_calls ?? []) streamed += t.function.arguments ?? "";
    }
  }
  assert.equal(streamed, call.function.arguments);
  // "auto": this story model answers in text.
  const free = await client.chat.completions.create({ ...req, tool_choice: "auto", max_tokens: 12 });
  assert.equal(typeof free.choices[0].message.content, "string");
});

await check("echo with logprobs (a continuation's loglikelihood)", async () => {
  const r = await client.completions.create({
    model, prompt: STORY, max_tokens: 1, temperature: 0, echo: true, logprobs: 1,
  });
  const c = r.choices[0];
  assert.ok(c.text.startsWith(STORY));
  assert.equal(c.logprobs.tokens.length, r.usage.prompt_tokens + 1);
  assert.equal(c.logprobs.token_logprobs[0], null);
  for (const lp of c.logprobs.token_logprobs.slice(1)) assert.ok(lp <= 0);
});

await check("a batch of prompts", async () => {
  // OpenAI's order: prompt p's choice i is choice p * n + i; each prompt is
  // counted once in the usage.
  const r = await client.completions.create({
    model, prompt: ["Once upon a time", "The dog"], max_tokens: 6,
    temperature: 0, n: 2,
  });
  assert.equal(r.choices.length, 4);
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2, 3]);
  assert.equal(r.choices[0].text, r.choices[1].text);  // greedy
  assert.notEqual(r.choices[0].text, r.choices[2].text);
  const one = await client.completions.create({
    model, prompt: "The dog", max_tokens: 6, temperature: 0,
  });
  assert.equal(r.choices[3].text, one.choices[0].text);
  const first = await client.completions.create({
    model, prompt: "Once upon a time", max_tokens: 6, temperature: 0,
  });
  assert.equal(r.usage.prompt_tokens,
               first.usage.prompt_tokens + one.usage.prompt_tokens);
});

await check("n choices (unary and stream)", async () => {
  const req = {
    model, messages: [{ role: "user", content: "Tell me a story." }],
    max_tokens: 16, temperature: 1.0, seed: 11, n: 3,
  };
  const r = await client.chat.completions.create(req);
  assert.equal(r.choices.length, 3);
  r.choices.forEach((c, i) => assert.equal(c.index, i));
  assert.equal(new Set(r.choices.map((c) => c.message.content)).size, 3);
  const stream = await client.chat.completions.create({
    ...req, stream: true, stream_options: { include_usage: true },
  });
  const texts = ["", "", ""];
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) texts[c.index] += c.delta.content ?? "";
  }
  assert.deepEqual(texts, r.choices.map((c) => c.message.content));
  assert.deepEqual(usage, r.usage);
});

await check("errors", async () => {
  const bad = new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);
  await assert.rejects(
      client.completions.create({ model, prompt: "x", n: 17 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  await assert.rejects(
      client.completions.create({ model: "no-such-model", prompt: "x" }),
      (e) => e instanceof OpenAI.NotFoundError);
  await assert.rejects(
      client.chat.completions.create({ model, messages: [] }),
      (e) => e.status === 400 && e.param === "messages");
});

await check("logprobs (completions and chat, unary and stream)", async () => {
  const req = {
    model, prompt: STORY, max_tokens: 16, temperature: 0, logprobs: 3,
    speculative_decoding: { enabled: true, num_draft_tokens: 4 },
  };
  const r = await client.completions.create(req);
  const lp = r.choices[0].logprobs;
  assert.equal(lp.tokens.length, r.usage.completion_tokens);
  assert.equal(lp.token_logprobs.length, lp.tokens.length);
  assert.equal(lp.top_logprobs.length, lp.tokens.length);
  assert.equal(lp.text_offset.length, lp.tokens.length);
  for (let i = 0; i < lp.tokens.length; i++) {
    assert.ok(lp.token_logprobs[i] <= 0);
    const top = Object.values(lp.top_logprobs[i]);
    assert.ok(top.length >= 3);
    // Greedy: the token is the likeliest.
    assert.ok(Math.abs(Math.max(...top) - lp.token_logprobs[i]) < 1e-6);
  }
  const s = await client.completions.create({ ...req, stream: true });
  const streamed = [];
  for await (const chunk of s) {
    for (const c of chunk.choices) {
      if (c.logprobs) streamed.push(...c.logprobs.tokens);
    }
  }
  assert.deepEqual(streamed, lp.tokens);

  const chatReq = {
    model, messages: MESSAGES, max_tokens: 8, temperature: 0,
    logprobs: true, top_logprobs: 2,
  };
  const c = await client.chat.completions.create(chatReq);
  const content = c.choices[0].logprobs.content;
  assert.equal(content.length, c.usage.completion_tokens);
  for (const t of content) {
    assert.equal(typeof t.token, "string");
    assert.ok(Array.isArray(t.bytes));
    assert.equal(t.top_logprobs.length, 2);
    assert.equal(t.top_logprobs[0].token, t.token);
  }
  const cs = await client.chat.completions.create({ ...chatReq, stream: true });
  const chatStreamed = [];
  for await (const chunk of cs) {
    for (const ch of chunk.choices) {
      if (ch.logprobs) chatStreamed.push(...ch.logprobs.content);
    }
  }
  assert.deepEqual(chatStreamed, content);
  await assert.rejects(
      client.chat.completions.create({ model, messages: MESSAGES, top_logprobs: 2 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "top_logprobs");
  await assert.rejects(
      client.completions.create({ model, prompt: "x", logprobs: 21 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === "logprobs");
});

await check("abort mid-stream", async () => {
  const controller = new AbortController();
  const s = await client.completions.create(
      { model, prompt: STORY, max_tokens: 400, ignore_eos: true, stream: true },
      { signal: controller.signal });
  let n = 0;
  try {  // the client ends the iteration or throws an abort error
    for await (const _ of s) {
      if (++n === 3) controller.abort();
    }
  } catch (e) {
    assert.ok(e.name === "AbortError" || e instanceof OpenAI.APIUserAbortError,
              String(e));
  }
  assert.equal(n, 3);
});
console.log("all checks passed");

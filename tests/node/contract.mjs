// The official openai Node client against a real `raychat serve`: streaming and non-streaming requests,
// limits, stop, seed reproducibility, logprobs, a multi-turn calculator conversation sent back as history,
// function calling, errors. Run by tests/test_serve_contract.py:
//   node contract.mjs BASE_URL EXPECTED.json
// EXPECTED.json holds the values the test worked out with the same weights in-process (greedy texts, logprobs).
// Prints one line per check; exits 1 at the first failure.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import OpenAI from "openai";

const [baseURL, expectedPath] = process.argv.slice(2);
const expected = JSON.parse(readFileSync(expectedPath, "utf8"));
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: "unused", maxRetries: 0 });
const model = expected.model;
const user = (content) => ({ role: "user", content });
const story = [user("Tell me a story.")];

async function check(name, fn) {
  await fn();
  console.log(`ok ${name}`);
}

async function rejected(body, status, param) {
  try {
    await client.chat.completions.create({ model, messages: story, ...body });
  } catch (err) {
    assert.ok(err instanceof OpenAI.APIError, `not an APIError: ${err}`);
    assert.equal(err.status, status, err.message);
    assert.equal(err.param ?? null, param, err.message);
    return err;
  }
  assert.fail(`${JSON.stringify(body)} was accepted`);
}

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

await check("models.list and models.retrieve name the served model", async () => {
  const listed = [];
  for await (const m of client.models.list()) listed.push(m);
  assert.deepEqual(listed.map((m) => m.id), [model]);
  // the id is the checkpoint's absolute path: the client sends each "/" as %2F
  assert.deepEqual(await client.models.retrieve(model), listed[0]);
  try {
    await client.models.retrieve(`${model}/other`);
    assert.fail("an unknown model was found");
  } catch (err) {
    assert.ok(err instanceof OpenAI.NotFoundError, `not a NotFoundError: ${err}`);
    assert.equal(err.code, "model_not_found", err.message);
  }
});

await check("max_completion_tokens and max_tokens limit the reply", async () => {
  for (const limit of [{ max_completion_tokens: 5 }, { max_tokens: 5 }]) {
    const r = await client.chat.completions.create({ model, messages: story, temperature: 0, ...limit });
    assert.equal(r.choices[0].message.content, expected.story5);
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.usage.completion_tokens, 5);
  }
});

await check("stop ends the reply before the stop string", async () => {
  const r = await client.chat.completions.create({ model, messages: story, temperature: 0, stop: ["upon"] });
  assert.equal(r.choices[0].message.content, expected.story_before_upon);
  assert.equal(r.choices[0].finish_reason, "stop");
});

await check("streaming gives the same text, then usage", async () => {
  const chunks = await collect(await client.chat.completions.create({
    model, messages: story, temperature: 0, max_completion_tokens: 5, stream: true,
    stream_options: { include_usage: true },
  }));
  const text = chunks.filter((c) => c.choices.length).map((c) => c.choices[0].delta.content ?? "").join("");
  assert.equal(text, expected.story5);
  assert.equal(chunks.at(-1).usage.completion_tokens, 5);
  assert.equal(new Set(chunks.map((c) => c.id)).size, 1);
});

await check("a seed reproduces a sampled reply; another seed changes it", async () => {
  const sample = async (seed) => (await client.chat.completions.create({
    model, messages: [user("xyzzy")], temperature: 2, seed, max_completion_tokens: 12,
  })).choices[0].message.content;
  const [a, b, c] = [await sample(7), await sample(7), await sample(8)];
  assert.equal(a, b);
  assert.notEqual(a, c);
  const many = await client.chat.completions.create({
    model, messages: [user("xyzzy")], temperature: 2, seed: 7, max_completion_tokens: 12, n: 2,
  });
  assert.equal(many.choices[0].message.content, a);  // choice 0 of any n uses the seed itself
  assert.notEqual(many.choices[1].message.content, a);
});

await check("logprobs", async () => {
  const body = { model, messages: story, temperature: 0, max_completion_tokens: 3, logprobs: true, top_logprobs: 2 };
  const r = await client.chat.completions.create(body);
  const got = r.choices[0].logprobs.content;
  assert.equal(got.length, expected.logprobs.length);
  got.forEach((entry, i) => {
    assert.deepEqual(entry.bytes, expected.logprobs[i].bytes);
    assert.ok(Math.abs(entry.logprob - expected.logprobs[i].logprob) < 1e-4);
    assert.equal(entry.top_logprobs.length, 2);
  });
});

await check("a calculator conversation, each reply sent back as history", async () => {
  const messages = [user("What is 47 * 12?")];
  const first = await client.chat.completions.create({ model, messages, temperature: 0 });
  const message = first.choices[0].message;
  assert.equal(message.content, "Let me compute it. #### 564");
  const [call] = message.tool_calls;
  assert.equal(call.type, "function");
  assert.equal(call.function.name, "calculator");
  assert.deepEqual(JSON.parse(call.function.arguments), { expression: "47 * 12" });
  assert.deepEqual(call.raychat, { offset: "Let me compute it. ".length, output: "564" });
  messages.push(message, user("And 5 + 6?"));
  const second = await client.chat.completions.create({ model, messages, temperature: 0 });
  assert.equal(second.choices[0].message.content, "Let me compute it. #### 11");
  assert.equal(second.choices[0].message.tool_calls[0].raychat.output, "11");
});

await check("the calculator streamed: no control tokens, the call as a tool_calls delta", async () => {
  const chunks = await collect(await client.chat.completions.create({
    model, messages: [user("What is 47 * 12?")], temperature: 0, stream: true,
  }));
  assert.ok(!JSON.stringify(chunks).includes("<|"));
  const calls = chunks.flatMap((c) => (c.choices[0]?.delta.tool_calls ?? []));
  assert.equal(calls[0].function.name, "calculator");
  assert.equal(calls[1].raychat.output, "564");
});

await check("function calling: declare the calculator, run it, send the result back", async () => {
  const tools = [{ type: "function", function: { name: "calculator", parameters: { type: "object" } } }];
  const messages = [user("What is 47 * 12?")];
  const step = await client.chat.completions.create({ model, messages, temperature: 0, tools });
  assert.equal(step.choices[0].finish_reason, "tool_calls");
  const call = step.choices[0].message.tool_calls[0];
  const { expression } = JSON.parse(call.function.arguments);
  const result = String(Function(`"use strict"; return (${expression.replace(/[^0-9+\-*/ ().]/g, "")})`)());
  messages.push(step.choices[0].message, { role: "tool", tool_call_id: call.id, content: result });
  const done = await client.chat.completions.create({ model, messages, temperature: 0, tools });
  assert.equal(done.choices[0].message.content, "#### 564");
  assert.equal(done.choices[0].finish_reason, "stop");
});

await check("errors name the parameter", async () => {
  await rejected({ temperature: 3 }, 400, "temperature");
  await rejected({ presence_penalty: 0.5 }, 400, "presence_penalty");
  await rejected({ response_format: { type: "json_object" } }, 400, "response_format.type");
  await rejected({ tools: [{ type: "function", function: { name: "search" } }] }, 400, "tools[0].function");
  const missing = await rejected({ model: "gpt-4" }, 404, "model");
  assert.equal(missing.code, "model_not_found");
});

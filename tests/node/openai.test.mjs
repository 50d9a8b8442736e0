// rd2h's OpenAI-compatible front, driven by the official `openai` client, unchanged, against
// a real rd2h proxy over real rd2h Prefill and Decode engines.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import OpenAI from 'openai';

import { startStack } from './stack.mjs';

const MODEL = 'rd2h-sim';

describe('an rd2h stack behind the OpenAI client', () => {
  let stack;
  let client;
  before(async () => {
    stack = await startStack();
    client = new OpenAI({ baseURL: `${stack.url}/v1`, apiKey: 'unused', maxRetries: 0,
      timeout: 60000 });
  });
  after(async () => { await stack?.stop(); });

  test('a completion has the OpenAI shape and exactly max_tokens tokens', async () => {
    const { data, response } = await client.completions
      .create({ model: MODEL, prompt: 'The capital of France is', max_tokens: 5 },
        { headers: { 'X-Request-Id': 'client-id-1' } })
      .withResponse();
    assert.equal(response.headers.get('x-request-id'), 'client-id-1');
    assert.equal(data.object, 'text_completion');
    assert.equal(data.model, MODEL);
    assert.ok(Number.isInteger(data.created) && data.created > 1.6e9, `created ${data.created}`);
    assert.match(data.id, /^cmpl-/);
    assert.equal(data.choices.length, 1);
    assert.equal(data.choices[0].index, 0);
    assert.equal(data.choices[0].text.length, 5);
    assert.equal(data.choices[0].finish_reason, 'length');
    assert.equal(data.choices[0].logprobs, null);
    // The simulated tokenizer: one token per byte of text.
    assert.deepEqual(data.usage, { prompt_tokens: 24, completion_tokens: 5, total_tokens: 29 });
  });

  test('a chat completion answers with a message', async () => {
    const chat = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hello' }],
      max_completion_tokens: 3,
    });
    assert.equal(chat.object, 'chat.completion');
    assert.match(chat.id, /^chatcmpl-/);
    assert.equal(chat.choices[0].message.role, 'assistant');
    assert.equal(chat.choices[0].message.content.length, 3);
    assert.equal(chat.choices[0].finish_reason, 'length');
    assert.equal(chat.usage.prompt_tokens, 'Be brief.'.length + 'Hello'.length);
    assert.equal(chat.usage.completion_tokens, 3);
  });

  test('a streamed completion carries one event per token, then its usage', async () => {
    const stream = await client.completions.create({
      model: MODEL, prompt: [1, 2, 3, 4, 5, 6, 7, 8], max_tokens: 6, stream: true,
      stream_options: { include_usage: true },
    });
    const texts = [];
    let finish = null;
    let usage = null;
    for await (const chunk of stream) {
      // OpenAI (and vLLM) name a completion's stream chunks as the completion itself.
      assert.equal(chunk.object, 'text_completion');
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices) {
        if (c.text) texts.push(c.text);
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(texts.length, 6, `events: ${JSON.stringify(texts)}`);
    assert.ok(texts.every((t) => t.length === 1), JSON.stringify(texts));
    assert.equal(finish, 'length');
    assert.deepEqual(usage, { prompt_tokens: 8, completion_tokens: 6, total_tokens: 14 });
  });

  test('a streamed chat sends deltas in chat.completion.chunk events', async () => {
    const stream = await client.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'Count to four' }], max_tokens: 4,
      stream: true,
    });
    let content = '';
    let role = null;
    let deltas = 0;
    let finish = null;
    for await (const chunk of stream) {
      assert.equal(chunk.object, 'chat.completion.chunk');
      assert.equal(chunk.model, MODEL);
      assert.equal(chunk.usage ?? null, null, 'no usage unless asked for');
      const c = chunk.choices[0];
      if (c.delta.role) role = c.delta.role;
      if (c.delta.content) {
        content += c.delta.content;
        ++deltas;
      }
      if (c.finish_reason) finish = c.finish_reason;
    }
    assert.equal(role, 'assistant');
    assert.equal(content.length, 4);
    assert.equal(deltas, 4);
    assert.equal(finish, 'length');
  });

  test('the client helper that collects a stream gets the whole answer', async () => {
    const runner = client.chat.completions.stream({
      model: MODEL, messages: [{ role: 'user', content: 'Hi there' }], max_tokens: 7,
    });
    const final = await runner.finalChatCompletion();
    assert.equal(final.choices[0].message.content.length, 7);
  });

  test('concurrent requests, streamed and not, all complete', async () => {
    const jobs = [];
    for (let i = 0; i < 12; ++i) {
      const prompt = 'x'.repeat(10 + 17 * i);
      if (i % 3 === 0) {
        jobs.push(client.chat.completions.create({ model: MODEL,
          messages: [{ role: 'user', content: prompt }], max_tokens: 3 })
          .then((r) => r.choices[0].message.content.length));
      } else if (i % 3 === 1) {
        jobs.push((async () => {
          let n = 0;
          const s = await client.completions.create({ model: MODEL, prompt, max_tokens: 3,
            stream: true });
          for await (const chunk of s) n += chunk.choices.reduce((a, c) => a + c.text.length, 0);
          return n;
        })());
      } else {
        jobs.push(client.completions.create({ model: MODEL, prompt, max_tokens: 3 })
          .then((r) => r.choices[0].text.length));
      }
    }
    assert.deepEqual(await Promise.all(jobs), new Array(12).fill(3));
  });

  test('a list of prompts is answered with one choice per prompt', async () => {
    const r = await client.completions.create({ model: MODEL, prompt: ['one', 'two two', 'three'],
      max_tokens: 2 });
    assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
    assert.ok(r.choices.every((c) => c.text.length === 2));
    assert.equal(r.usage.prompt_tokens, 3 + 7 + 5);
    assert.equal(r.usage.completion_tokens, 6);
  });

  // The status, param and code of the error the client throws for a request.
  async function refusal(call) {
    try {
      await call();
    } catch (e) {
      assert.ok(e instanceof OpenAI.APIError, `not an APIError: ${e}`);
      return { status: e.status, param: e.param, code: e.code, type: e.type, message: e.message };
    }
    assert.fail('the request was not refused');
  }

  test('unsupported options are refused with a 400 naming them', async () => {
    for (const [extra, param] of [[{ n: 2 }, 'n'], [{ best_of: 3 }, 'best_of'],
      [{ echo: true }, 'echo'], [{ logprobs: 2 }, 'logprobs'], [{ suffix: '!' }, 'suffix'],
      [{ stop: ['\n'] }, 'stop']]) {
      const e = await refusal(() => client.completions.create({ model: MODEL, prompt: 'hi',
        max_tokens: 2, ...extra }));
      assert.equal(e.status, 400, JSON.stringify(extra));
      assert.equal(e.param, param);
      assert.equal(e.code, 'unsupported_parameter');
      assert.equal(e.type, 'invalid_request_error');
      assert.match(e.message, new RegExp(param));
    }
    const e = await refusal(() => client.chat.completions.create({ model: MODEL,
      messages: [{ role: 'user', content: 'hi' }], tools: [{ type: 'function',
        function: { name: 'f', parameters: {} } }] }));
    assert.equal(e.status, 400);
    assert.equal(e.param, 'tools');
  });

  test('wrong field types are 400 naming the field', async () => {
    for (const [body, param] of [
      [{ prompt: 'hi', max_tokens: 'five' }, 'max_tokens'],
      [{ prompt: 'hi', max_tokens: 0 }, 'max_tokens'],
      [{ prompt: 'hi', temperature: 'hot' }, 'temperature'],
      [{ prompt: 'hi', stream: 'yes' }, 'stream'],
      [{ prompt: 'hi', stream_options: { include_usage: true } }, 'stream_options'],
      [{ prompt: 7 }, 'prompt'],
      [{}, 'prompt']]) {
      const e = await refusal(() => client.completions.create({ model: MODEL, ...body }));
      assert.equal(e.status, 400, JSON.stringify(body));
      assert.equal(e.param, param, JSON.stringify(body));
    }
    const e = await refusal(() => client.chat.completions.create({ model: MODEL,
      messages: [{ role: 'user', content: 5 }] }));
    assert.equal(e.status, 400);
    assert.equal(e.param, 'messages[0].content');
  });

  test('a prompt longer than the engine holds is a 400, streamed or not', async () => {
    for (const stream of [false, true]) {
      const e = await refusal(() => client.completions.create({ model: MODEL,
        prompt: 'z'.repeat(64 * 16 + 1), max_tokens: 4, stream }));
      assert.equal(e.status, 400);
      assert.equal(e.param, 'prompt');
      assert.equal(e.code, 'context_length_exceeded');
      assert.match(e.message, /the engine holds 1024 tokens/);
    }
  });

  test('an unknown model is a 404', async () => {
    const e = await refusal(() => client.completions.create({ model: 'gpt-nothing',
      prompt: 'hi' }));
    assert.equal(e.status, 404);
    assert.equal(e.code, 'model_not_found');
    assert.match(e.message, /gpt-nothing/);
  });

  test('the models list names the served model', async () => {
    const models = [];
    for await (const m of client.models.list()) models.push(m.id);
    assert.deepEqual(models, [MODEL]);
  });

  test('the proxy and the engines serve Prometheus metrics', async () => {
    const proxy = await fetch(`${stack.url}/metrics`);
    assert.equal(proxy.status, 200);
    assert.match(proxy.headers.get('content-type'), /^text\/plain; version=0\.0\.4/);
    const text = await proxy.text();
    const served = text.match(
      /^rd2h_http_requests_total\{listener="api",route="\/v1\/completions",status="200"\} (\d+)$/m);
    assert.ok(served && Number(served[1]) > 0, text);
    assert.match(text, /^rd2h_proxy_time_to_first_token_seconds_count \d+$/m);
    const decode = await (await fetch(`${stack.decode.origin}/metrics`)).text();
    const bytes = decode.match(/^rd2h_kv_bytes_read_total (\d+)$/m);
    assert.ok(bytes && Number(bytes[1]) > 0, decode);
  });

  test('health and version answer', async () => {
    const health = await fetch(`${stack.url}/health`);
    assert.equal(health.status, 200);
    const h = await health.json();
    assert.equal(h.status, 'ok');
    assert.deepEqual(h.prefill.map((p) => p.healthy), [true]);
    assert.deepEqual(h.decode.map((p) => p.healthy), [true]);
    const version = await (await fetch(`${stack.url}/version`)).json();
    assert.match(version.version, /^\d+\.\d+\.\d+/);
  });
});

describe('a proxy that requires an API key', () => {
  let stack;
  before(async () => { stack = await startStack({ proxyArgs: ['--api-key', 'sk-rd2h-test'] }); });
  after(async () => { await stack?.stop(); });

  test('refuses a client without the key and serves one with it', async () => {
    const wrong = new OpenAI({ baseURL: `${stack.url}/v1`, apiKey: 'sk-wrong', maxRetries: 0 });
    await assert.rejects(
      wrong.completions.create({ model: MODEL, prompt: 'hi', max_tokens: 1 }),
      (e) => e instanceof OpenAI.AuthenticationError && e.status === 401 &&
        e.code === 'invalid_api_key');
    const right = new OpenAI({ baseURL: `${stack.url}/v1`, apiKey: 'sk-rd2h-test',
      maxRetries: 0 });
    const r = await right.completions.create({ model: MODEL, prompt: 'hi', max_tokens: 2 });
    assert.equal(r.choices[0].text.length, 2);
    // Probes need no key.
    assert.equal((await fetch(`${stack.url}/health`)).status, 200);
  });
});

describe('a Decode that ends streams recomputed', () => {
  let stack;
  let client;
  before(async () => {
    stack = await startStack({ decodeArgs: ['--test-recompute-after', '3'] });
    client = new OpenAI({ baseURL: `${stack.url}/v1`, apiKey: 'unused', maxRetries: 0,
      timeout: 60000 });
  });
  after(async () => { await stack?.stop(); });

  test('a stream goes on from a new Prefill and Decode and reads as one answer', async () => {
    const stream = await client.chat.completions.create({
      model: MODEL, messages: [{ role: 'user', content: 'Tell me a long story' }],
      max_completion_tokens: 9, stream: true, stream_options: { include_usage: true },
    });
    const ids = new Set();
    let content = '';
    let finishes = 0;
    let usage;
    for await (const event of stream) {
      ids.add(event.id);
      if (event.usage) usage = event.usage;
      const c = event.choices[0];
      if (!c) continue;
      assert.notEqual(c.stop_reason, 'recomputed');
      content += c.delta?.content ?? '';
      if (c.finish_reason) {
        ++finishes;
        assert.equal(c.finish_reason, 'length');
      }
    }
    assert.equal(ids.size, 1);
    assert.equal(content.length, 9);
    assert.equal(finishes, 1);
    assert.equal(usage.completion_tokens, 9);
    const metrics = await (await fetch(`${stack.url}/metrics`)).text();
    const reissues = Number(metrics.match(/^rd2h_proxy_recomputed_reissues_total (\d+)/m)[1]);
    assert.ok(reissues >= 2, `${reissues} rounds begun for 9 tokens at 3 per round`);
  });
});

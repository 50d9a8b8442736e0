// The official OpenAI Node client as tests/vllm's second user: reads a JSON list of asks on
// stdin ({kind: "completion" | "chat", prompt, stream, max_tokens}), sends each to the
// OpenAI-compatible server at argv[2], prints the answers' texts as a JSON list.
import OpenAI from 'openai';

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${baseURL}/v1`, apiKey: 'unused', maxRetries: 0,
                            timeout: 600_000 });

async function ask({ kind, prompt, stream, max_tokens }) {
  const common = { model, max_tokens, temperature: 0 };
  if (kind === 'chat') {
    const messages = [{ role: 'user', content: prompt }];
    if (!stream) {
      const r = await client.chat.completions.create({ ...common, messages });
      return r.choices[0].message.content;
    }
    let text = '';
    for await (const ev of await client.chat.completions.create({ ...common, messages,
                                                                 stream: true })) {
      for (const ch of ev.choices) text += ch.delta.content ?? '';
    }
    return text;
  }
  if (!stream) {
    const r = await client.completions.create({ ...common, prompt });
    return r.choices[0].text;
  }
  let text = '';
  for await (const ev of await client.completions.create({ ...common, prompt, stream: true })) {
    for (const ch of ev.choices) text += ch.text;
  }
  return text;
}

let input = '';
for await (const chunk of process.stdin) input += chunk;
const answers = [];
for (const a of JSON.parse(input)) answers.push(await ask(a));
process.stdout.write(JSON.stringify(answers));

// Starts `rd2h decode`, `rd2h prefill` and `rd2h proxy` on loopback as an operator would,
// from the binary in $RD2H_BINARY, and stops them (SIGTERM, then SIGKILL after a bound).
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { createInterface } from 'node:readline';

const binary = process.env.RD2H_BINARY;
if (!binary) throw new Error('RD2H_BINARY must name the rd2h binary');

const model = ['--layers', '4', '--block-size', '16', '--num-blocks', '64',
  '--bytes-per-token', '64,8,16'];

// Starts one process and resolves with its first stdout line holding `serving http://...`.
function serve(args, label) {
  const child = spawn(binary, args, { stdio: ['ignore', 'pipe', 'pipe'] });
  let output = '';
  const lines = createInterface({ input: child.stdout });
  child.stderr.on('data', (d) => { output += d; });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`${label} did not start within 60 s: ${output}`));
    }, 60000);
    child.once('exit', (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${label} exited (${code ?? signal}) before serving: ${output}`));
    });
    lines.on('line', (line) => {
      output += line + '\n';
      const m = line.match(/serving (http:\/\/[^ ]+)/);
      if (m) {
        clearTimeout(timer);
        child.removeAllListeners('exit');
        resolve({ child, origin: m[1], output: () => output });
      }
    });
  });
}

async function stop(p) {
  if (!p || p.child.exitCode !== null || p.child.signalCode !== null) return;
  const exited = once(p.child, 'exit');
  p.child.kill('SIGTERM');
  const timer = setTimeout(() => p.child.kill('SIGKILL'), 15000);
  await exited;
  clearTimeout(timer);
}

// The whole stack; `proxyArgs` go to the proxy (e.g. ['--api-key', k]), `decodeArgs` to
// Decode.
export async function startStack({ proxyArgs = [], decodeArgs = [] } = {}) {
  const started = [];
  try {
    let decode;
    for (let attempt = 0; !decode; ++attempt) {
      const kvPort = 20000 + Math.floor(Math.random() * 40000);
      const config = JSON.stringify({ kv_connector: 'rd2h', kv_role: 'kv_consumer',
        kv_port: kvPort, kv_connector_extra_config: { transport: 'shm', prefill_tp_size: 1 } });
      try {
        decode = await serve(['decode', ...model, '--kv-transfer-config', config, ...decodeArgs],
          'rd2h decode');
      } catch (e) {
        if (attempt >= 5) throw e;  // its kv ports may have been taken: try others
      }
    }
    started.push(decode);
    const prefill = await serve(['prefill', ...model, '--kv-transfer-config',
      JSON.stringify({ kv_connector: 'rd2h', kv_role: 'kv_producer', kv_port: 1,
        kv_connector_extra_config: { transport: 'shm' } })], 'rd2h prefill');
    started.push(prefill);
    const proxy = await serve(['proxy', '--prefill', prefill.origin, '--decode', decode.origin,
      ...proxyArgs], 'rd2h proxy');
    started.push(proxy);
    return {
      url: proxy.origin,
      decode, prefill, proxy,
      async stop() { for (const p of started.reverse()) await stop(p); },
    };
  } catch (e) {
    for (const p of started.reverse()) await stop(p);
    throw e;
  }
}

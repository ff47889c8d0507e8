// What every Node interop scenario shares: the server (from bench/interop.py's environment), the
// test speech, and the one JSON line a scenario prints.
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';

const audio = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'tests', 'serve', 'audio');
export const WSS = process.env.INTEROP_WSS ?? 'wss://127.0.0.1:8443';
export const MODEL = process.env.INTEROP_MODEL ?? 'moshi-tiny';

// The 16-bit PCM samples of a mono 24 kHz test WAV (its "data" chunk).
export function pcm24k(name) {
  const wav = readFileSync(join(audio, name));
  let at = 12;
  while (wav.toString('ascii', at, at + 4) !== 'data') at += 8 + wav.readUInt32LE(at + 4);
  return wav.subarray(at + 8, at + 8 + wav.readUInt32LE(at + 4));
}

export class Checks {
  constructor(client, version) {
    Object.assign(this, { client, version, passed: [], failed: {} });
  }

  check(name, ok, why = 'failed') {
    if (ok) this.passed.push(name);
    else this.failed[name] = String(why);
    return ok;
  }

  report() {
    console.log(JSON.stringify({ client: this.client, version: this.version, passed: this.passed, failed: this.failed }));
    process.exit(Object.keys(this.failed).length ? 1 : 0);
  }
}

export function version(pkg) {
  const root = join(dirname(fileURLToPath(import.meta.url)), 'node_modules', pkg, 'package.json');
  return JSON.parse(readFileSync(root, 'utf8')).version;
}

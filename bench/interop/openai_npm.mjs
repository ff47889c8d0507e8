// The openai npm client's OpenAIRealtimeWS against cadence-fx serve over wss:// (it never speaks
// plain ws://): a manual turn with response metadata, then a cancel with nothing active.
import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';
import { Checks, MODEL, WSS, pcm24k, version } from './common.mjs';

const checks = new Checks('openai (npm)', version('openai'));
const client = new OpenAI({ apiKey: 'unused', baseURL: WSS.replace('wss://', 'https://') + '/v1' });
const rt = new OpenAIRealtimeWS({ model: MODEL }, client);
const events = [];
let deltas = 0;

const finished = new Promise((resolve, reject) => {
  rt.on('error', (error) => events.push({ type: 'sdk-error', error: String(error.message ?? error) }));
  rt.on('event', (event) => {
    events.push(event);
    if (event.type === 'response.output_audio.delta') deltas += 1;
    if (event.type === 'response.done') {
      rt.send({ type: 'response.cancel', event_id: 'cancel_idle' });
    }
    if (event.type === 'error' && event.error.event_id === 'cancel_idle') resolve();
  });
  rt.socket.on('error', reject);
  setTimeout(() => reject(new Error('no reply within 30 s')), 30_000);
});

rt.socket.on('open', () => {
  rt.send({ type: 'session.update', session: { type: 'realtime', model: MODEL, audio: { input: { turn_detection: null } } } });
  const pcm = pcm24k('question_24k.wav');
  for (let i = 0; i < pcm.length; i += 9600) {
    rt.send({ type: 'input_audio_buffer.append', audio: pcm.subarray(i, i + 9600).toString('base64') });
  }
  rt.send({ type: 'input_audio_buffer.commit' });
  rt.send({ type: 'response.create', response: { metadata: { client_event_id: 'rc_npm' } } });
});

try {
  await finished;
  const of = (type) => events.filter((e) => e.type === type);
  checks.check('connects over wss:// (TLS)', of('session.created').length === 1);
  checks.check('session.update accepted', of('session.updated').length === 1, JSON.stringify(of('error')));
  checks.check('manual turn answered with audio', deltas > 0, `${deltas} deltas`);
  const done = of('response.done')[0];
  checks.check('response.metadata echoed', JSON.stringify(done.response.metadata) === '{"client_event_id":"rc_npm"}',
    JSON.stringify(done.response.metadata));
  const idle = of('error').at(-1).error;
  checks.check("cancel with nothing active: OpenAI's wording",
    idle.code === 'response_cancel_not_active' && idle.message.startsWith('Cancellation failed'), JSON.stringify(idle));
} catch (error) {
  checks.check('turn over wss://', false, `${error.message}; events: ${events.map((e) => e.type).join(', ')}`);
}
rt.close();
checks.report();

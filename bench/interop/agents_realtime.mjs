// @openai/agents-realtime's RealtimeSession (WebSocket transport) against cadence-fx serve over
// wss://: its default session config (semantic_vad, transcription) and its tracing update, then a
// spoken turn answered with audio, the turn not restarted by the second update.
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebSocket } from '@openai/agents-realtime';
import { Checks, MODEL, WSS, pcm24k, version } from './common.mjs';

const checks = new Checks('@openai/agents-realtime', version('@openai/agents-realtime'));
const agent = new RealtimeAgent({ name: 'interop', instructions: 'Answer briefly.' });
const session = new RealtimeSession(agent, {
  transport: new OpenAIRealtimeWebSocket({ useInsecureApiKey: true }),
  model: MODEL,
});
const events = [];
let audioBytes = 0;
session.on('transport_event', (event) => events.push(event));
session.on('audio', (event) => { audioBytes += event.data.byteLength; });
session.on('error', (error) => events.push({ type: 'session-error', error: String(error.error?.message ?? error.error) }));

const of = (type) => events.filter((e) => e.type === type);
const until = async (predicate, ms) => {
  const deadline = Date.now() + ms;
  while (!predicate() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  return predicate();
};

try {
  await session.connect({ apiKey: 'unused', url: `${WSS}/v1/realtime?model=${MODEL}` });
  await until(() => of('session.updated').length >= 1, 10_000);
  const pcm = pcm24k('question_24k.wav');
  const silence = Buffer.alloc(48 * 800);
  const speech = Buffer.concat([pcm, silence]);
  for (let i = 0; i < speech.length; i += 4800) {
    const chunk = speech.subarray(i, i + 4800);
    session.sendAudio(chunk.buffer.slice(chunk.byteOffset, chunk.byteOffset + chunk.byteLength));
    await new Promise((r) => setTimeout(r, 20));
  }
  await until(() => of('response.done').length >= 1, 30_000);
  const updated = of('session.updated');
  checks.check('default session.update (semantic_vad, transcription) and the tracing update accepted',
    updated.length === 2 && updated[1].session.tracing === 'auto' && of('error').length === 0,
    `${updated.length} session.updated; errors: ${JSON.stringify(of('error').map((e) => e.error))}`);
  checks.check('spoken turn answered with audio', audioBytes > 0, `${audioBytes} bytes of audio`);
  checks.check('one speech_started per spoken turn (no VAD restart)', of('input_audio_buffer.speech_started').length === 1,
    `${of('input_audio_buffer.speech_started').length} speech_started`);
} catch (error) {
  checks.check('session over wss://', false, `${error.message}; events: ${events.map((e) => e.type).join(', ')}`);
}
session.close();
checks.report();

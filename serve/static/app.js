// The cadence-fx browser page: microphone -> Realtime WebSocket -> playback, no dependencies.
// window.cadence holds what the page counted, so a headless browser test can read it.
"use strict";

const RATE = 24000; // audio/pcm on the wire: 16-bit, 24 kHz, mono
const $ = (id) => document.getElementById(id);

// The jitter buffer: a reply starts playing this far behind its first chunk, and so does its
// playback again after an underrun, so chunks that arrive unevenly (the network, a busy server)
// play back to back instead of with a gap each time one is late.
const JITTER_S = 0.15;

const stats = {
  sessionId: null, turns: 0, replies: 0, bargeIns: 0, receivedSamples: 0, playedMs: 0,
  latenciesMs: [], errors: [], playing: 0, underruns: 0, transcript: "",
};
window.cadence = stats;

let ws = null;
let ctx = null;
let mic = null;
let output = null;      // gain node every reply chunk plays through
let analyser = null;
let playing = new Set(); // scheduled AudioBufferSourceNodes
let playhead = 0;        // context time where the next chunk starts
let turnEndedAt = null;  // performance.now() at the last speech_stopped
let reply = null;        // {id, itemId, firstAudio, playedSamples}
let meterTimer = null;

function log(text, isError) {
  const line = document.createElement("div");
  line.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  if (isError) line.className = "error";
  $("log").prepend(line);
}

function setTurn(which) {
  for (const id of ["listening", "user", "waiting", "model"]) {
    $(`turn-${id}`).classList.toggle("on", id === which);
  }
}

function level(id, rms) {
  const db = rms > 0 ? 20 * Math.log10(rms) : -Infinity;
  $(`${id}-level`).style.width = `${Math.max(0, Math.min(100, (db + 60) * 100 / 60))}%`;
  $(`${id}-db`).textContent = Number.isFinite(db) ? `${db.toFixed(0)} dB` : "-inf dB";
}

function rmsOf(samples) {
  let sum = 0;
  for (const x of samples) sum += x * x;
  return Math.sqrt(sum / Math.max(1, samples.length));
}

function toBase64Pcm16(samples) {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const x = Math.max(-1, Math.min(1, samples[i]));
    pcm[i] = x < 0 ? x * 0x8000 : x * 0x7fff;
  }
  const bytes = new Uint8Array(pcm.buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function fromBase64Pcm16(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  const out = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) out[i] = pcm[i] / 0x8000;
  return out;
}

function send(event) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event));
}

// A server started with --api-key asks for it on every route but /health: here as a bearer token,
// on the WebSocket as the subprotocol OpenAI's browser clients offer (a browser sets no headers there).
function apiKey() {
  return $("key").value.trim();
}

// A refused handshake reaches a page only as close code 1006, with no reason: the same question
// asked of an HTTP route (the same key, the same access rules) says why.
async function refusal() {
  try {
    const answer = await fetch("/v1/models", apiKey() ? { headers: { Authorization: `Bearer ${apiKey()}` } } : {});
    if (answer.status === 401) {
      return apiKey() ? "the server refused this API key" : "the server asks for an API key: enter it in the key field";
    }
    if (!answer.ok) return `the server refused the connection (HTTP ${answer.status})`;
    return null;
  } catch (error) {
    return `the server cannot be reached (${error})`;
  }
}

async function loadModels() {
  const select = $("model");
  select.replaceChildren();
  try {
    const answer = await fetch("/v1/models", apiKey() ? { headers: { Authorization: `Bearer ${apiKey()}` } } : {});
    if (!answer.ok) throw new Error(`HTTP ${answer.status}${answer.status === 401 ? ": enter the server's API key" : ""}`);
    const models = (await answer.json()).data;
    for (const m of models) {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = `${m.id} (${m.input_rate / 1000} kHz in, ${m.output_rate / 1000} kHz out)`;
      select.append(option);
    }
  } catch (error) {
    log(`GET /v1/models failed: ${error}`, true);
  }
}

// When a chunk arriving at ``now`` starts: right after the chunk before it, unless playback has
// run dry (the reply's first chunk, or one late past the end of what was scheduled): then
// JITTER_S from now. ``underrun``: it was late, in a reply that had started. Pure, for the test.
function schedule(playhead, now, started) {
  if (playhead >= now) return { start: playhead, underrun: false };
  return { start: now + JITTER_S, underrun: started };
}
window.cadenceSchedule = schedule;

function play(samples) {
  const buffer = ctx.createBuffer(1, samples.length, RATE);
  buffer.copyToChannel(samples, 0);
  const source = ctx.createBufferSource();
  source.buffer = buffer;
  source.connect(output);
  const slot = schedule(playhead, ctx.currentTime, playing.size > 0 || Boolean(reply && reply.playedSamples));
  if (slot.underrun) stats.underruns += 1;
  playhead = slot.start;
  source.start(playhead);
  playhead += buffer.duration;
  const current = reply;
  playing.add(source);
  stats.playing = playing.size;
  source.onended = () => {
    if (!playing.delete(source)) return; // stopped by a barge-in: not played
    stats.playing = playing.size;
    stats.playedMs += buffer.duration * 1000;
    if (current) current.playedSamples += samples.length;
    if (playing.size === 0) setTurn("listening");
  };
}

// User speech over a reply that is still playing: stop playback and tell the server how much
// of the reply the user heard, so its conversation keeps only that.
function bargeIn() {
  const heard = reply;
  for (const source of playing) source.stop();
  playing.clear();
  stats.playing = 0;
  playhead = 0;
  stats.bargeIns += 1;
  $("barge-ins").textContent = stats.bargeIns;
  $("barge").classList.add("on");
  setTimeout(() => $("barge").classList.remove("on"), 1500);
  if (heard) {
    send({
      type: "conversation.item.truncate", item_id: heard.itemId, content_index: 0,
      audio_end_ms: Math.floor(heard.playedSamples * 1000 / RATE),
    });
  }
  log("barge-in: playback stopped");
}

function onEvent(event) {
  switch (event.type) {
    case "session.created":
      stats.sessionId = event.session.id;
      $("status").textContent = `connected: ${event.session.id}`;
      log(`session ${event.session.id} (${event.session.model})`);
      break;
    case "input_audio_buffer.speech_started":
      if (playing.size > 0) bargeIn();
      setTurn("user");
      break;
    case "input_audio_buffer.speech_stopped":
      turnEndedAt = performance.now();
      stats.turns += 1;
      $("turns").textContent = stats.turns;
      setTurn("waiting");
      break;
    case "response.created":
      reply = { id: event.response.id, itemId: null, firstAudio: false, playedSamples: 0 };
      if (stats.transcript) stats.transcript += "\n"; // a line per reply
      break;
    case "response.output_item.added":
      if (reply) reply.itemId = event.item.id;
      break;
    case "response.output_audio.delta": {
      const samples = fromBase64Pcm16(event.delta);
      stats.receivedSamples += samples.length;
      if (reply && !reply.firstAudio) {
        reply.firstAudio = true;
        if (turnEndedAt !== null) {
          const ms = Math.round(performance.now() - turnEndedAt);
          stats.latenciesMs.push(ms);
          const sorted = [...stats.latenciesMs].sort((a, b) => a - b);
          $("latency").textContent = `${ms} / ${sorted[sorted.length >> 1]} ms`;
          turnEndedAt = null;
        }
      }
      play(samples);
      setTurn("model");
      break;
    }
    case "response.output_audio_transcript.delta":
      stats.transcript += event.delta;
      $("transcript").textContent = stats.transcript;
      break;
    case "response.done":
      stats.replies += 1;
      $("replies").textContent = stats.replies;
      log(`reply ${event.response.id}: ${event.response.status}`);
      break;
    case "error":
      stats.errors.push(event.error);
      log(`error ${event.error.code}: ${event.error.message}`, true);
      break;
    default:
      break;
  }
}

function meters() {
  const samples = new Float32Array(analyser.fftSize);
  analyser.getFloatTimeDomainData(samples);
  level("out", rmsOf(samples));
}

async function start() {
  $("start").disabled = true;
  $("status").textContent = "connecting";
  const model = $("model").value;
  try {
    ctx = new AudioContext({ sampleRate: RATE });
    await ctx.audioWorklet.addModule("/static/capture-worklet.js");
    mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
    });
  } catch (error) {
    log(`microphone: ${error}`, true);
    $("start").disabled = false;
    return;
  }
  output = ctx.createGain();
  analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  output.connect(analyser).connect(ctx.destination);
  const capture = new AudioWorkletNode(ctx, "capture");
  const silent = ctx.createGain();
  silent.gain.value = 0; // keeps the capture node pulled by the graph without echoing the mic
  ctx.createMediaStreamSource(mic).connect(capture).connect(silent).connect(ctx.destination);
  capture.port.onmessage = (message) => {
    level("in", rmsOf(message.data));
    send({ type: "input_audio_buffer.append", audio: toBase64Pcm16(message.data) });
  };
  meterTimer = setInterval(meters, 50);

  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const protocols = ["realtime", ...(apiKey() ? [`openai-insecure-api-key.${apiKey()}`] : [])];
  ws = new WebSocket(`${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`, protocols);
  let opened = false;
  ws.onopen = () => {
    opened = true;
    send({
      type: "session.update",
      session: {
        type: "realtime", model,
        audio: {
          input: { format: { type: "audio/pcm", rate: RATE }, turn_detection: { type: "server_vad" } },
          output: { format: { type: "audio/pcm", rate: RATE } },
        },
      },
    });
    setTurn("listening");
    $("stop").disabled = false;
  };
  ws.onmessage = (message) => onEvent(JSON.parse(message.data));
  ws.onclose = async (close) => {
    stop();
    const why = opened ? close.reason : (await refusal()) || close.reason;
    $("status").textContent = `closed (${close.code}${why ? ": " + why : ""})`;
  };
  ws.onerror = () => log("WebSocket error", true);
}

function stop() {
  if (ws) { const socket = ws; ws = null; socket.close(); }
  if (mic) { mic.getTracks().forEach((t) => t.stop()); mic = null; }
  if (meterTimer) { clearInterval(meterTimer); meterTimer = null; }
  if (ctx) { ctx.close(); ctx = null; }
  playing.clear();
  setTurn(null);
  $("start").disabled = false;
  $("stop").disabled = true;
}

$("start").onclick = start;
$("stop").onclick = stop;
$("key").addEventListener("change", loadModels);
loadModels();

// Runs on the audio thread: collects the microphone's samples into 100 ms blocks for the page.
class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.block = new Float32Array(sampleRate / 10);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0][0];
    if (channel) {
      let offset = 0;
      while (offset < channel.length) {
        const n = Math.min(channel.length - offset, this.block.length - this.filled);
        this.block.set(channel.subarray(offset, offset + n), this.filled);
        this.filled += n;
        offset += n;
        if (this.filled === this.block.length) {
          this.port.postMessage(this.block);
          this.block = new Float32Array(this.block.length);
          this.filled = 0;
        }
      }
    }
    return true;
  }
}

registerProcessor("capture", Capture);

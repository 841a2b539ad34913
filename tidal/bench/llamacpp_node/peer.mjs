// llama.cpp for `tidal bench engine --itl-only` (tidal/bench/engine_peer.py starts one per thread count).
// node-llama-cpp with its prebuilt CPU binaries: greedy decode of token ids on a GGUF, per-token times.
//   node peer.mjs MODEL.gguf THREADS CONTEXT
// stdout: one JSON line {"ready": ..., "llama_cpp": "bNNNN"}, then one line per request read from stdin:
//   in  {"prompt": [ids...], "output": N}
//   out {"itl_ms": [...], "cpu_ms": [...], "tokens": [ids...]}  (ms between consecutive tokens, CPU ms this
//   process (all its threads) used between them; the greedy tokens made)
import {createInterface} from "node:readline";
import {getLlama} from "node-llama-cpp";

const [modelPath, threads, context] = process.argv.slice(2);
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath});
const ctx = await model.createContext({contextSize: Number(context), threads: Number(threads),
                                       batchSize: Math.min(Number(context), 512)});
const seq = ctx.getSequence();
console.log(JSON.stringify({ready: true, llama_cpp: llama.llamaCppRelease.release, build: llama.buildType,
                            threads: ctx.currentThreads}));

for await (const line of createInterface({input: process.stdin})) {
  if (!line.trim()) continue;
  const {prompt, output} = JSON.parse(line);
  await seq.clearHistory();
  const stamps = [];
  const cpu = [];
  const tokens = [];
  for await (const token of seq.evaluate(prompt, {temperature: 0})) {
    stamps.push(performance.now());
    const used = process.cpuUsage();
    cpu.push((used.user + used.system) / 1000);
    tokens.push(token);
    if (stamps.length >= output) break;
  }
  console.log(JSON.stringify({itl_ms: stamps.slice(1).map((s, i) => s - stamps[i]),
                              cpu_ms: cpu.slice(1).map((c, i) => c - cpu[i]), tokens}));
}
await ctx.dispose();
await model.dispose();

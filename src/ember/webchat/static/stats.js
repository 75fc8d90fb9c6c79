// What a finished turn says about its latency and how it ended: pure functions
// from a turn's record to the labels the page shows.
//
// A turn record (built by chat.js while the answer streams):
//   ttftMs      request sent -> first text, as this browser saw it (null: no text came)
//   firstAt, lastAt  performance.now() of the first and last text chunk
//   chunks      text chunks received (about one per token with Ember)
//   usage       the final chunk's OpenAI `usage` (null when the stream was cut before it)
//   finish, stopReason   the final chunk's finish_reason and stop_reason
//   stopped     the user stopped it;  error   a message, when the stream failed
//   waits       [{status, ms}] for each 429/503 the turn waited out before it was served
//   maxTokens   max_tokens the server applied (X-Ember-Max-Tokens), clamped (X-Ember-Max-Tokens-Clamped)

/** The per-turn figures, in display order: [{key, text, title, tier?}]. Only the ones the turn has. */
export function turnStats(turn) {
  const stats = [];
  if (turn.ttftMs !== null) {
    stats.push({ key: "ttft", text: `TTFT ${formatMs(turn.ttftMs)}`, title: "Time to first token: from sending the request to the first text" });
  }
  const rate = tokensPerSecond(turn);
  if (rate !== null) {
    stats.push({
      key: "rate",
      text: `${rate.approximate ? "≈" : ""}${rate.value.toFixed(1)} tok/s`,
      title: rate.approximate ? "Text chunks per second (the stream ended before the server counted tokens)" : "Generated tokens per second after the first one",
    });
  }
  const usage = turn.usage;
  if (usage) {
    if (typeof usage.completion_tokens === "number") {
      stats.push({ key: "completion", text: `${usage.completion_tokens} tokens`, title: "Tokens generated" });
    }
    stats.push({ key: "prompt", text: `prompt ${usage.prompt_tokens}`, title: "Prompt tokens: the whole conversation, sent again every turn" });
    const details = usage.prompt_tokens_details ?? {};
    if (typeof details.cached_tokens === "number") {
      stats.push({ key: "cached", text: `cached ${details.cached_tokens}`, title: "Prompt tokens whose KV state the server reused instead of computing" });
    }
    if (typeof details.cache_tier === "string") {
      const tier = details.cache_tier;
      stats.push({ key: "tier", text: TIER_LABELS[tier] ?? tier, tier: tier === "disk" ? "warm" : tier, title: TIER_TITLES[tier] ?? "Where the conversation's KV state was found" });
    }
  }
  if (turn.waits.length) {
    const waited = turn.waits.reduce((sum, w) => sum + w.ms, 0);
    const statuses = [...new Set(turn.waits.map((w) => w.status))].join("/");
    const n = turn.waits.length;
    stats.push({ key: "retries", text: `served after ${n} ${n === 1 ? "retry" : "retries"} (${statuses}, waited ${formatMs(waited)})`, title: "The server was busy and asked us to wait (Retry-After)" });
  }
  if (turn.clamped) {
    stats.push({ key: "clamped", text: `max_tokens lowered to ${turn.maxTokens} by the server`, title: "X-Ember-Max-Tokens-Clamped" });
  }
  if (turn.degraded) {
    stats.push({ key: "degraded", text: "server degraded", title: "X-Ember-Degraded: the server is shedding load to protect latency" });
  }
  return stats;
}

// Ember's usage.prompt_tokens_details.cache_tier: hot, warm (RAM), disk (the warm tier's files) or cold.
const TIER_LABELS = { disk: "warm (disk)" };
const TIER_TITLES = {
  hot: "Hot: the conversation's KV blocks were still in the server's pool",
  warm: "Warm: the conversation's KV state was restored from the server's RAM",
  disk: "Warm: the conversation's KV state was restored from the server's disk",
  cold: "Cold: nothing cached, the whole prompt was computed",
};

/** How the turn ended, when a person should be told: {kind, text}, or null for a normal end. */
export function turnEnding(turn) {
  const partial = turn.chunks > 0 ? " The partial answer is kept." : "";
  if (turn.error) return { kind: "error", text: `${turn.chunks > 0 ? "The answer broke off" : "Failed"}: ${turn.error}${partial}` };
  if (turn.stopped) return { kind: "stopped", text: `Stopped.${partial}` };
  if (turn.finish === "length" && turn.stopReason === "timeout") {
    return { kind: "deadline", text: `Deadline passed: the server stopped this answer at the request's time limit (stop_reason: timeout).${partial}` };
  }
  if (turn.finish === "length") {
    const limit = turn.usage?.max_tokens ?? turn.maxTokens;
    return { kind: "length", text: `Cut at max_tokens${limit ? ` (${limit})` : ""}: raise it in Settings for longer answers.` };
  }
  if (turn.finish === null && turn.chunks > 0) return { kind: "error", text: `The stream ended without a finish.${partial}` };
  if (turn.finish !== null && turn.finish !== "stop") return { kind: "other", text: `Finished: ${turn.finish}.` };
  return null;
}

/** Tokens per second after the first token: from the server's count, else (stopped) from chunks. */
export function tokensPerSecond(turn) {
  if (turn.firstAt === null || turn.lastAt === null || turn.lastAt <= turn.firstAt) return null;
  const seconds = (turn.lastAt - turn.firstAt) / 1000;
  const tokens = turn.usage?.completion_tokens;
  if (typeof tokens === "number" && tokens > 1) return { value: (tokens - 1) / seconds, approximate: false };
  if (turn.chunks > 1) return { value: (turn.chunks - 1) / seconds, approximate: true };
  return null;
}

export function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

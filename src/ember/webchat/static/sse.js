// The OpenAI streaming wire format, as the page reads it from a fetch() Response.

/** What readEvents yields for the stream's closing `data: [DONE]`. */
export const DONE = Symbol("DONE");

/**
 * The events of a `text/event-stream` body: each `data:` payload parsed as
 * JSON, or DONE. Lines may end in \n, \r\n or \r, and chunks may split them
 * anywhere. Aborting the fetch's signal makes the pending read throw an
 * AbortError, which propagates to the caller.
 */
export async function* readEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        return;
      }
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop(); // the line still being received
      for (const line of lines) {
        if (line === "") {
          // A blank line ends an event (an extra one, as from a \r\n split across chunks, ends nothing).
          if (data.length) yield parse(data.join("\n"));
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        } // comments (":...") and other fields (event:, id:, retry:) carry nothing the page needs
      }
    }
  } finally {
    if (!finished) reader.cancel().catch(() => {});
  }
}

function parse(payload) {
  if (payload === "[DONE]") return DONE;
  try {
    return JSON.parse(payload);
  } catch {
    return { error: { message: `The server sent a chunk that is not JSON: ${payload.slice(0, 80)}` } };
  }
}

/**
 * How long the server asks us to wait before retrying, in ms, or null when it
 * says nothing: `retry-after-ms` if present, else `Retry-After` (seconds, or an HTTP date).
 */
export function retryDelayMs(headers) {
  const ms = headers.get("retry-after-ms");
  if (ms !== null && ms.trim() !== "" && Number.isFinite(Number(ms)) && Number(ms) >= 0) return Number(ms);
  const value = headers.get("retry-after");
  if (value === null || value.trim() === "") return null;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const date = Date.parse(value);
  return Number.isNaN(date) ? null : Math.max(0, date - Date.now());
}

/** The message of an error response: OpenAI's `error.message`, else the body's text, else the status. */
export async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const message = JSON.parse(text)?.error?.message;
    if (typeof message === "string" && message) return message;
  } catch {
    // not JSON: fall through to the text itself
  }
  return text.trim().slice(0, 300) || `HTTP ${response.status} ${response.statusText}`.trim();
}

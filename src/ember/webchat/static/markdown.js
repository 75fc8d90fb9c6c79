// Markdown to DOM nodes, for model output.
//
// Safe by construction: text reaches the page only as Text nodes (append of a
// string, textContent), never through innerHTML or any HTML parser, so an
// answer containing "<script>" or "<img onerror=...>" shows those characters.
// Links are made only for absolute http:, https: and mailto: URLs (never
// javascript: or relative ones); images are never loaded (that would let an
// answer send the conversation to another site), they become links.
//
// The subset a chat answer uses: fenced code (a fence still open runs to the
// end, as while an answer streams in), `inline code`, **bold**, *italic*,
// _italic_, ~~strike~~, # headings, - * + and 1. lists (nested by indent),
// > quotes, --- rules, [links](url), bare URLs, paragraphs keeping their line
// breaks. Anything else is shown as the text it is.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

const INLINE = new RegExp(
  [
    "(`+)([^`][\\s\\S]*?)\\1(?!`)", // 1, 2: code span
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3: bold
    "(?<!\\w)__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)", // 4: bold
    "~~(?=\\S)([\\s\\S]*?\\S)~~", // 5: strike
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 6: italic
    "(?<!\\w)_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // 7: italic
    "(!?)\\[([^\\]\\n]*)\\]\\(\\s*<?([^\\s<>()]+)>?(?:\\s+\"[^\"\\n]*\")?\\s*\\)", // 8, 9, 10: image or link
    "(https?:\\/\\/[^\\s<>\"'`]*[^\\s<>\"'`.,;:!?)\\]*_])", // 11: bare URL
  ].join("|"),
  "g",
);

const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

/** The DOM of `source` rendered as Markdown: a DocumentFragment of elements and Text nodes only. */
export function renderMarkdown(source) {
  const root = document.createDocumentFragment();
  renderBlocks(String(source).replace(/\r\n?/g, "\n").split("\n"), root);
  return root;
}

/** An absolute URL a link may point to, or null (javascript:, data:, relative, malformed...). */
export function safeUrl(raw) {
  try {
    const url = new URL(raw);
    return LINK_PROTOCOLS.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function element(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function isClosingFence(line, fence) {
  const trimmed = line.trim();
  return trimmed.length >= fence.length && trimmed[0] === fence[0] && /^(`+|~+)$/.test(trimmed);
}

// Every branch consumes at least one line, so the loop always ends.
function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const body = [];
      for (i++; i < lines.length && !isClosingFence(lines[i], m[1]); i++) body.push(lines[i]);
      i++; // the closing fence, or past the end while the answer is still streaming
      const pre = element("pre");
      if (m[2]) pre.dataset.lang = m[2];
      const code = element("code");
      code.textContent = body.join("\n");
      pre.append(code);
      parent.append(pre);
    } else if ((m = HEADING.exec(line))) {
      const heading = element(`h${m[1].length}`);
      renderInline(m[2], heading, false);
      parent.append(heading);
      i++;
    } else if (RULE.test(line)) {
      parent.append(element("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) inner.push(m[1]);
      const quote = element("blockquote");
      renderBlocks(inner, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      i = renderList(lines, i, parent);
    } else {
      const text = [];
      for (; i < lines.length && lines[i].trim() && (text.length === 0 || !startsBlock(lines[i])); i++) text.push(lines[i]);
      const paragraph = element("p");
      renderInline(text.join("\n"), paragraph, false);
      parent.append(paragraph);
    }
  }
}

// A list starting at lines[i]; returns the index of the first line after it.
function renderList(lines, i, parent) {
  const first = ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[2]);
  const indent = first[1].length;
  const list = element(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  let itemLines = null;
  const finishItem = () => {
    if (itemLines === null) return;
    const item = element("li");
    if (itemLines.length === 1) renderInline(itemLines[0], item, false);
    else renderBlocks(itemLines, item);
    list.append(item);
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
      finishItem(); // a sibling item
      itemLines = [m[3]];
    } else if (!line.trim()) {
      const next = lines[i + 1];
      if (next === undefined || !(ITEM.test(next) || /^\s{2,}\S/.test(next))) break;
      itemLines.push("");
    } else if (/^\s+\S/.test(line) && !(m && m[1].length <= indent + 1)) {
      itemLines.push(line.replace(/^\s{1,4}/, "")); // inside the item (a nested list, a second paragraph)
    } else if (startsBlock(line)) {
      break;
    } else {
      itemLines.push(line); // a wrapped line of the item's text
    }
    i++;
  }
  finishItem();
  parent.append(list);
  return i;
}

// Inline spans of `text` appended to `parent`; inside a link, bare URLs stay text (no nested links).
function renderInline(text, parent, inLink) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(text.slice(last, m.index));
    parent.append(inlineNode(m, inLink));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function inlineNode(m, inLink) {
  if (m[1] !== undefined) {
    const code = element("code");
    code.textContent = m[2].replace(/^ (.*) $/s, "$1");
    return code;
  }
  const wrapped = [["strong", m[3] ?? m[4]], ["del", m[5]], ["em", m[6] ?? m[7]]].find(([, inner]) => inner !== undefined);
  if (wrapped) {
    const node = element(wrapped[0]);
    renderInline(wrapped[1], node, inLink);
    return node;
  }
  if (m[9] !== undefined) {
    const href = inLink ? null : safeUrl(m[10]);
    if (href === null) return document.createTextNode(m[0]);
    const link = anchor(href);
    if (m[8]) link.textContent = `image: ${m[9] || href}`;
    else renderInline(m[9] || href, link, true);
    return link;
  }
  const href = inLink ? null : safeUrl(m[11]);
  if (href === null) return document.createTextNode(m[0]);
  const link = anchor(href);
  link.textContent = m[11];
  return link;
}

function anchor(href) {
  const link = element("a");
  link.href = href;
  link.target = "_blank";
  link.rel = "noopener noreferrer nofollow";
  return link;
}

// A small markdown renderer for the model's replies: paragraphs, headings, lists, fenced
// code blocks, **bold**, *italic*, `code` and links.
// Invariant (no injection): the whole text is HTML-escaped first, and every tag or
// attribute in the result comes from the patterns below, never from the text itself;
// link targets are limited to http(s) and mailto, and code classes to [\w+#.-].
"use strict";

const FENCE = /^\s*```\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;

function escapeHtml(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return text.replace(/[&<>"']/g, (c) => entities[c]);
}

// Code spans and links are set aside (as \0 index \0) so emphasis never applies inside.
function renderInline(text) {
  const kept = [];
  const keep = (html) => `\u0000${kept.push(html) - 1}\u0000`;
  return text
    .replace(/`([^`\n]+)`/g, (_, code) => keep(`<code>${code}</code>`))
    .replace(/\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g, (_, label, url) =>
      keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`))
    .replace(/\*\*(?=\S)(.+?)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*(?=\S)(.+?)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|\W)_(?=\S)(.+?)_(?!\w)/g, "$1<em>$2</em>")
    .replace(/\u0000(\d+)\u0000/g, (_, i) => kept[i]);
}

function isListItem(line, ordered) {
  const match = line !== undefined && line.match(LIST_ITEM);
  return Boolean(match) && /\d/.test(match[1]) === ordered;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || LIST_ITEM.test(line);
}

function renderMarkdown(markdown) {
  const lines = escapeHtml(markdown.replace(/\u0000/g, "")).split("\n");
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if ((match = line.match(FENCE))) {
      const code = [];
      for (i++; i < lines.length && !/^\s*```/.test(lines[i]); i++) code.push(lines[i]);
      i++; // the closing fence (absent while a reply is still streaming)
      const lang = match[1] ? ` class="language-${match[1]}"` : "";
      html.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
    } else if ((match = line.match(HEADING))) {
      const level = match[1].length;
      html.push(`<h${level}>${renderInline(match[2])}</h${level}>`);
      i++;
    } else if ((match = line.match(LIST_ITEM))) {
      const ordered = /\d/.test(match[1]);
      const items = [];
      while (i < lines.length) {
        if (isListItem(lines[i], ordered)) {
          items.push(`<li>${renderInline(lines[i].match(LIST_ITEM)[2])}</li>`);
        } else if (lines[i].trim() || !isListItem(lines[i + 1], ordered)) {
          break; // a blank line between two items stays inside the list
        }
        i++;
      }
      const open = ordered ? `<ol start="${parseInt(match[1], 10)}">` : "<ul>";
      html.push(`${open}${items.join("")}${ordered ? "</ol>" : "</ul>"}`);
    } else if (!line.trim()) {
      i++;
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) {
        paragraph.push(lines[i++]);
      }
      html.push(`<p>${renderInline(paragraph.join("\n")).replace(/\n/g, "<br>")}</p>`);
    }
  }
  return html.join("\n");
}

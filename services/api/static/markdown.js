// A small Markdown renderer for answers: fenced code kept exactly as typed, inline code,
// bold, italics, headings, lists, links. Everything is escaped first, so no text a model
// writes can become markup; only http(s) links are made.
const escape = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

function inline(text) {
  return escape(text)
    .replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^*\w])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
      '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
}

function blocks(text) {
  const html = [];
  let list = null;
  const closeList = () => { if (list) { html.push(`</${list}>`); list = null; } };
  let paragraph = [];
  const closeParagraph = () => {
    if (paragraph.length) html.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    paragraph = [];
  };
  for (const line of text.split("\n")) {
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/);
    if (heading) {
      closeParagraph(); closeList();
      const tag = `h${Math.min(heading[1].length + 2, 6)}`;  // h1 in an answer is h3 here
      html.push(`<${tag}>${inline(heading[2])}</${tag}>`);
    } else if (item) {
      closeParagraph();
      const kind = item[1] ? "ul" : "ol";
      if (list !== kind) { closeList(); html.push(`<${kind}>`); list = kind; }
      html.push(`<li>${inline(item[3])}</li>`);
    } else if (!line.trim()) {
      closeParagraph(); closeList();
    } else {
      closeList();
      paragraph.push(line);
    }
  }
  closeParagraph(); closeList();
  return html.join("");
}

// Text outside fences as blocks; a fence still open (mid-stream) runs to the end.
export function renderMarkdown(text) {
  const parts = text.split(/^```/m);
  return parts.map((part, i) => {
    if (i % 2 === 0) return blocks(part);
    const newline = part.indexOf("\n");
    const lang = newline < 0 ? part : part.slice(0, newline);
    const code = newline < 0 ? "" : part.slice(newline + 1).replace(/\n$/, "");
    const label = lang.trim() ? ` data-lang="${escape(lang.trim())}"` : "";
    return `<pre${label}><code>${escape(code)}</code></pre>`;
  }).join("");
}

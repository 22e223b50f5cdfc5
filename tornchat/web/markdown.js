// A small markdown renderer that builds DOM nodes and sets only textContent:
// whatever the text holds (tags, scripts, entities) ends up as text. Fenced
// code blocks, headings, lists, block quotes, paragraphs; inline code, bold,
// italics and http(s) links. A fence still open (a reply mid-stream) runs to
// the end of the text.
"use strict";

window.TornchatMarkdown = (function () {
  const FENCE = /^\s*(```|~~~)\s*([\w+.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;
  // One inline span: `code`, **strong**, *em*, or [text](http(s) url).
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g;

  function element(tag, children) {
    const node = document.createElement(tag);
    for (const child of children || []) node.append(child);
    return node;
  }

  function inline(text) {
    const nodes = [];
    let last = 0;
    for (const match of text.matchAll(INLINE)) {
      if (match.index > last) nodes.push(document.createTextNode(text.slice(last, match.index)));
      last = match.index + match[0].length;
      if (match[1]) {
        const code = element("code");
        code.textContent = match[2];
        nodes.push(code);
      } else if (match[3] !== undefined) {
        nodes.push(element("strong", inline(match[3])));
      } else if (match[4] !== undefined) {
        nodes.push(element("em", inline(match[4])));
      } else {
        const link = element("a", inline(match[5]));
        link.href = match[6];
        link.rel = "noopener noreferrer";
        link.target = "_blank";
        nodes.push(link);
      }
    }
    if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
    return nodes;
  }

  // Lines joined with <br>, each line's inline spans rendered.
  function lines(texts) {
    const nodes = [];
    texts.forEach((text, i) => {
      if (i) nodes.push(element("br"));
      nodes.push(...inline(text));
    });
    return nodes;
  }

  function render(text) {
    const fragment = document.createDocumentFragment();
    const source = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < source.length) {
      const line = source[i];
      let match;
      if (!line.trim()) {
        i++;
      } else if ((match = FENCE.exec(line))) {
        const body = [];
        for (i++; i < source.length && !(FENCE.test(source[i]) && source[i].trim().startsWith(match[1])); i++) body.push(source[i]);
        i++;  // the closing fence
        const code = element("code");
        code.textContent = body.join("\n");
        if (match[2]) code.dataset.language = match[2];
        fragment.append(element("pre", [code]));
      } else if ((match = HEADING.exec(line))) {
        fragment.append(element("h" + Math.min(match[1].length + 2, 6), inline(match[2])));
        i++;
      } else if ((match = BULLET.exec(line) || NUMBERED.exec(line))) {
        const pattern = BULLET.test(line) ? BULLET : NUMBERED;
        const list = element(pattern === BULLET ? "ul" : "ol");
        if (pattern === NUMBERED && match[1] !== "1") list.start = Number(match[1]);
        for (; i < source.length && (match = pattern.exec(source[i])); i++) {
          list.append(element("li", inline(match[match.length - 1])));
        }
        fragment.append(list);
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < source.length && (match = QUOTE.exec(source[i])); i++) quoted.push(match[1]);
        fragment.append(element("blockquote", lines(quoted)));
      } else {
        const paragraph = [];
        for (; i < source.length && source[i].trim() && !FENCE.test(source[i]) && !HEADING.test(source[i])
               && !BULLET.test(source[i]) && !NUMBERED.test(source[i]) && !QUOTE.test(source[i]); i++) {
          paragraph.push(source[i]);
        }
        fragment.append(element("p", lines(paragraph)));
      }
    }
    return fragment;
  }

  return { render };
})();

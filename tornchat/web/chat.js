// The chat page: conversations in localStorage, replies streamed from our own
// /v1/chat/completions. Text from the user and the model only ever reaches
// the page as textContent (markdown.js builds its nodes the same way).
"use strict";

(function () {
  const AUTH = document.querySelector('meta[name="tornchat-auth"]').content;  // bearer | basic | none
  const MODEL = document.querySelector('meta[name="tornchat-model"]').content;
  const CONVERSATIONS_KEY = "tornchat.conversations";
  const CURRENT_KEY = "tornchat.current";
  const SETTINGS_KEY = "tornchat.settings";
  const CREDENTIAL_KEY = "tornchat.credential";  // sessionStorage: gone when the tab closes
  const SETTINGS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "tools", "tool_choice", "schema", "logprobs"];
  const TOP_LOGPROBS = 5;

  const $ = (id) => document.getElementById(id);
  const ui = {
    conversations: $("conversations"), title: $("title"), messages: $("messages"), error: $("error"),
    input: $("input"), send: $("send"), stop: $("stop"), settings: $("settings"), settingsButton: $("settings-button"),
    settingsError: $("settings-error"), keyButton: $("key-button"), keyDialog: $("key-dialog"),
    keyPrompt: $("key-prompt"), keyInput: $("key-input"),
  };

  // ---- state ------------------------------------------------------------------------

  function load(storage, key, fallback) {
    try {
      const value = JSON.parse(storage.getItem(key));
      return value === null ? fallback : value;
    } catch (error) {
      return fallback;  // a damaged entry must not keep the page from starting
    }
  }

  const state = {
    conversations: load(localStorage, CONVERSATIONS_KEY, []),
    currentId: load(localStorage, CURRENT_KEY, null),
    settings: load(localStorage, SETTINGS_KEY, {}),
    generation: null,  // {controller, conversation} while a reply streams
  };

  function save() {
    localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(state.conversations));
    localStorage.setItem(CURRENT_KEY, JSON.stringify(state.currentId));
  }

  function current() {
    let conversation = state.conversations.find((c) => c.id === state.currentId);
    if (!conversation) conversation = newConversation();
    return conversation;
  }

  function newConversation() {
    const id = (crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random());
    const conversation = { id, title: "New chat", messages: [] };
    state.conversations.unshift(conversation);
    state.currentId = id;
    save();
    return conversation;
  }

  // ---- rendering --------------------------------------------------------------------

  function make(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function button(text, onClick, className) {
    const node = make("button", className, text);
    node.type = "button";
    node.addEventListener("click", onClick);
    return node;
  }

  function renderSidebar() {
    ui.conversations.replaceChildren(...state.conversations.map((conversation) => {
      const item = make("li", conversation.id === state.currentId ? "current" : "");
      const open = button(conversation.title, () => { state.currentId = conversation.id; save(); renderAll(); }, "open");
      const rename = button("Rename", () => startRename(item, conversation), "rename");
      const remove = button("Delete", () => deleteConversation(conversation), "delete");
      rename.title = "Rename";
      remove.title = "Delete";
      item.append(open, rename, remove);
      return item;
    }));
  }

  function startRename(item, conversation) {
    const field = make("input", "rename-field");
    field.value = conversation.title;
    const finish = (keep) => {
      if (keep && field.value.trim()) conversation.title = field.value.trim();
      save();
      renderAll();
    };
    field.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      if (event.key === "Escape") finish(false);
    });
    field.addEventListener("blur", () => finish(true));
    item.replaceChildren(field);
    field.focus();
    field.select();
  }

  function deleteConversation(conversation) {
    if (state.generation && state.generation.conversation === conversation) state.generation.controller.abort();
    state.conversations = state.conversations.filter((c) => c !== conversation);
    if (state.currentId === conversation.id) state.currentId = state.conversations.length ? state.conversations[0].id : null;
    save();
    renderAll();
  }

  function renderMessages() {
    const conversation = current();
    ui.title.textContent = conversation.title;
    ui.messages.replaceChildren(...conversation.messages.map((message, index) => messageView(conversation, message, index)));
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function messageView(conversation, message, index) {
    const view = make("article", "message " + message.role);
    view.dataset.index = index;
    const body = make("div", "body");
    view.append(make("div", "role", message.role === "user" ? "You" : "Assistant"), body);
    fillBody(view, message);
    if (message.role === "user") {
      const edit = button("Edit", () => startEdit(view, conversation, index), "edit");
      view.querySelector(".role").append(edit);
    }
    return view;
  }

  // The parts of a message that grow while it streams: its text, its calls, its figures.
  function fillBody(view, message) {
    const body = view.querySelector(".body");
    if (message.role === "user") {
      body.replaceChildren(make("div", "plain", message.content));
    } else if (message.logprobs && message.logprobs.length && view.dataset.view === "tokens") {
      body.replaceChildren(tokensView(message.logprobs));
    } else {
      body.replaceChildren(TornchatMarkdown.render(message.content || ""));
    }
    for (const call of message.tool_calls || []) {
      const box = make("div", "call");
      box.append(make("span", "call-label", "call"), make("span", "call-name", call.function.name),
                 make("pre", "call-arguments", call.function.arguments));
      body.append(box);
    }
    if (message.error) body.append(make("div", "reply-error", message.error));
    let footer = view.querySelector(".stats");
    if (message.stats) {
      if (!footer) {
        footer = make("div", "stats");
        view.append(footer);
      }
      footer.replaceChildren(...statsItems(message.stats));
      if (message.logprobs && message.logprobs.length) {
        footer.append(button(view.dataset.view === "tokens" ? "Text" : "Token probabilities", () => {
          view.dataset.view = view.dataset.view === "tokens" ? "" : "tokens";
          fillBody(view, message);
        }, "toggle-tokens"));
      }
    }
  }

  function statsItems(stats) {
    const items = [];
    const add = (name, text) => items.push(make("span", "stat " + name, text));
    if (stats.ttft_ms !== undefined) add("ttft", `TTFT ${Math.round(stats.ttft_ms)} ms`);
    if (stats.tokens_per_s !== undefined) add("speed", `${stats.tokens_per_s.toFixed(1)} tokens/s`);
    if (stats.prompt_tokens !== undefined) add("prompt", `prompt ${stats.prompt_tokens} tokens (${stats.cached_tokens || 0} cached)`);
    if (stats.completion_tokens !== undefined) add("completion", `${stats.completion_tokens} tokens`);
    if (stats.finish_reason) add("finish", `finish: ${stats.finish_reason}`);
    return items;
  }

  // One span per token, shaded by its probability; clicking one lists the alternatives.
  function tokensView(logprobs) {
    const view = make("div", "tokens");
    const detail = make("div", "token-detail");
    detail.hidden = true;
    const text = make("div", "token-text");
    for (const entry of logprobs) {
      const p = Math.exp(entry.logprob);
      const span = make("span", "token p" + Math.min(4, Math.floor(p * 5)), entry.token);
      span.title = `${(100 * p).toFixed(1)}%`;
      span.addEventListener("click", () => {
        const rows = (entry.top_logprobs || []).map((alt) => {
          const row = make("li", alt.token === entry.token ? "chosen" : "");
          row.append(make("code", "", JSON.stringify(alt.token)), make("span", "", ` ${(100 * Math.exp(alt.logprob)).toFixed(1)}%`));
          return row;
        });
        const list = make("ol");
        list.append(...rows);
        detail.replaceChildren(make("div", "", `${JSON.stringify(entry.token)}: ${(100 * p).toFixed(1)}%`), list);
        detail.hidden = false;
      });
      text.append(span);
    }
    view.append(text, detail);
    return view;
  }

  function startEdit(view, conversation, index) {
    const field = make("textarea", "edit-field");
    field.value = conversation.messages[index].content;
    field.rows = Math.min(10, field.value.split("\n").length + 1);
    const resend = button("Send", () => {
      const options = field.value.trim() && readyToSend();
      if (!options) return;
      // Everything after the edited message is dropped; the prefix before it is
      // the same, so the server takes it from the KV cache (see "cached").
      conversation.messages = conversation.messages.slice(0, index);
      conversation.messages.push({ role: "user", content: field.value });
      save();
      renderMessages();
      generate(conversation, options);
    }, "resend");
    const cancel = button("Cancel", renderMessages, "cancel");
    view.querySelector(".body").replaceChildren(field, resend, cancel);
    field.focus();
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
  }

  function showError(text) {
    ui.error.textContent = text || "";
    ui.error.hidden = !text;
  }

  // ---- settings -----------------------------------------------------------------------

  function readSettings() {
    for (const name of SETTINGS) {
      const field = $("s-" + name);
      state.settings[name] = field.type === "checkbox" ? field.checked : field.value;
    }
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
  }

  function writeSettings() {
    for (const name of SETTINGS) {
      const field = $("s-" + name);
      const value = state.settings[name];
      if (field.type === "checkbox") field.checked = Boolean(value);
      else field.value = value === undefined ? "" : value;
    }
  }

  function parseJSON(text, what) {
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new Error(`${what} is not valid JSON: ${error.message}`);
    }
  }

  // The request fields the settings ask for; throws with a message naming a bad setting.
  function requestOptions() {
    const s = state.settings;
    const options = {};
    for (const name of ["temperature", "top_p"]) if (s[name] !== "" && s[name] !== undefined) options[name] = Number(s[name]);
    for (const name of ["top_k", "max_tokens", "seed"]) if (s[name] !== "" && s[name] !== undefined) options[name] = parseInt(s[name], 10);
    const stops = (s.stop || "").split("\n").filter((line) => line);
    if (stops.length) options.stop = stops;
    if ((s.tools || "").trim()) {
      options.tools = parseJSON(s.tools, "Tools");
      const choice = (s.tool_choice || "").trim();
      if (["auto", "none", "required"].includes(choice)) options.tool_choice = choice;
      else if (choice) options.tool_choice = { type: "function", function: { name: choice } };
    }
    if ((s.schema || "").trim()) {
      const schema = parseJSON(s.schema, "The JSON schema");
      // A whole response_format object is sent as it is; a bare schema is wrapped.
      options.response_format = schema.type === "json_schema" || schema.type === "json_object" ? schema
        : { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
    }
    if (s.logprobs) {
      options.logprobs = true;
      options.top_logprobs = TOP_LOGPROBS;
    }
    return options;
  }

  function apiMessages(conversation) {
    const messages = [];
    if ((state.settings.system || "").trim()) messages.push({ role: "system", content: state.settings.system });
    for (const message of conversation.messages) {
      if (message.role === "assistant" && !message.content && !(message.tool_calls || []).length) continue;  // a failed reply
      const sent = { role: message.role, content: message.content };
      if (message.tool_calls && message.tool_calls.length) sent.tool_calls = message.tool_calls;
      messages.push(sent);
    }
    return messages;
  }

  // ---- credentials ----------------------------------------------------------------------

  function credential() {
    return sessionStorage.getItem(CREDENTIAL_KEY);
  }

  function authorization() {
    const value = credential();
    if (AUTH === "none" || !value) return {};
    if (AUTH === "bearer") return { Authorization: "Bearer " + value };
    const bytes = new TextEncoder().encode(value);  // user:password may be any Unicode
    return { Authorization: "Basic " + btoa(String.fromCharCode(...bytes)) };
  }

  function askForKey(message) {
    ui.keyPrompt.textContent = message || (AUTH === "bearer" ? "This server needs an API key." : "This server needs a user name and password, as user:password.");
    ui.keyInput.value = "";
    if (!ui.keyDialog.open) ui.keyDialog.showModal();
    ui.keyInput.focus();
  }

  function saveKey() {
    if (!ui.keyInput.value) return;
    sessionStorage.setItem(CREDENTIAL_KEY, ui.keyInput.value);
    ui.keyDialog.close();
    ui.input.focus();
  }

  // ---- generation -------------------------------------------------------------------------

  // The request fields from the settings, or null (the problem shown, nothing sent, the text kept).
  function readyToSend() {
    if (state.generation) {
      showError("A reply is still being generated: wait for it, or press Stop.");
      return null;
    }
    if (AUTH !== "none" && !credential()) {
      askForKey();
      return null;
    }
    try {
      showError("");
      return requestOptions();
    } catch (error) {
      showError(error.message);
      return null;
    }
  }

  function send() {
    const text = ui.input.value;
    const options = text.trim() && readyToSend();
    if (!options) return;
    const conversation = current();
    if (!conversation.messages.length) conversation.title = text.trim().split("\n")[0].slice(0, 40);
    conversation.messages.push({ role: "user", content: text });
    ui.input.value = "";
    save();
    renderAll();
    generate(conversation, options);
  }

  function setGenerating(on) {
    ui.send.hidden = on;
    ui.stop.hidden = !on;
    document.body.classList.toggle("generating", on);
  }

  async function generate(conversation, options) {
    const reply = { role: "assistant", content: "", stats: {} };
    const body = { model: MODEL, messages: apiMessages(conversation), stream: true, stream_options: { include_usage: true }, ...options };
    conversation.messages.push(reply);
    const controller = new AbortController();
    state.generation = { controller, conversation };
    setGenerating(true);
    const index = conversation.messages.length - 1;
    // The reply's element, found afresh each time: switching conversations re-renders the list.
    const update = () => {
      if (state.currentId !== conversation.id) return;
      let view = ui.messages.querySelector(`.message[data-index="${index}"]`);
      if (!view) {
        view = messageView(conversation, reply, index);
        ui.messages.append(view);
      }
      view.classList.toggle("streaming", state.generation !== null);
      const atBottom = ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 40;
      fillBody(view, reply);
      if (atBottom) ui.messages.scrollTop = ui.messages.scrollHeight;
    };
    update();
    const started = performance.now();
    const timing = { first: null, last: null, pieces: 0 };
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", ...authorization() },
        body: JSON.stringify(body),
        signal: controller.signal,
        // The key travels in our own header; with credentials the browser would
        // answer a refused Basic login with its own password dialog.
        credentials: "omit",
      });
      if (!response.ok) {
        const detail = await response.json().then((b) => b.detail, () => response.statusText);
        if (response.status === 401) {
          sessionStorage.removeItem(CREDENTIAL_KEY);
          askForKey("The server refused that key; enter it again.");
        }
        throw new Error(`${response.status}: ${detail}`);
      }
      for await (const chunk of records(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) Object.assign(reply.stats, usageStats(chunk.usage));
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (applyDelta(reply, delta, choice.logprobs || delta.logprobs)) {
          const now = performance.now();
          if (timing.first === null) {
            timing.first = now;
            reply.stats.ttft_ms = now - started;
          }
          timing.last = now;
          timing.pieces++;
        }
        if (choice.finish_reason) reply.stats.finish_reason = choice.finish_reason;
        update();
      }
    } catch (error) {
      if (error.name === "AbortError") reply.stats.finish_reason = "stopped";
      else reply.error = error.message;
    } finally {
      // Decode speed: tokens after the first over the time they took.
      const tokens = reply.stats.completion_tokens !== undefined ? reply.stats.completion_tokens : timing.pieces;
      if (timing.first !== null && timing.last > timing.first && tokens > 1) {
        reply.stats.tokens_per_s = (tokens - 1) / ((timing.last - timing.first) / 1000);
      }
      if (reply.stats.completion_tokens === undefined && timing.pieces) reply.stats.completion_tokens = timing.pieces;
      state.generation = null;
      setGenerating(false);
      update();
      save();
    }
  }

  function usageStats(usage) {
    return {
      prompt_tokens: usage.prompt_tokens,
      completion_tokens: usage.completion_tokens,
      cached_tokens: (usage.prompt_tokens_details || {}).cached_tokens || 0,
    };
  }

  // Adds one streamed delta to the reply; true if it carried generated text or a call.
  function applyDelta(reply, delta, logprobs) {
    let grew = false;
    if (delta.content) {
      reply.content += delta.content;
      grew = true;
    }
    if (logprobs && logprobs.content) {
      reply.logprobs = (reply.logprobs || []).concat(logprobs.content);
    }
    const calls = delta.tool_calls || (delta.function_call ? [{ index: 0, function: delta.function_call }] : []);
    for (const part of calls) {
      reply.tool_calls = reply.tool_calls || [];
      let call = reply.tool_calls[part.index || 0];
      if (!call) {
        call = { id: part.id || `call_${part.index || 0}`, type: "function", function: { name: "", arguments: "" } };
        reply.tool_calls[part.index || 0] = call;
      }
      const fn = part.function || {};
      if (fn.name) call.function.name += fn.name;
      if (fn.arguments) call.function.arguments += fn.arguments;
      grew = true;
    }
    return grew;
  }

  // The JSON objects of an SSE stream, up to data: [DONE].
  async function* records(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const record = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = record.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trim()).join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  // ---- wiring ---------------------------------------------------------------------------------

  ui.input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  ui.send.addEventListener("click", send);
  ui.stop.addEventListener("click", () => state.generation && state.generation.controller.abort());
  $("new-chat").addEventListener("click", () => {
    newConversation();
    renderAll();
    ui.input.focus();
  });
  ui.settingsButton.addEventListener("click", () => {
    ui.settings.hidden = !ui.settings.hidden;
    ui.settingsButton.setAttribute("aria-expanded", String(!ui.settings.hidden));
  });
  ui.settings.addEventListener("input", () => {
    readSettings();
    try {
      requestOptions();
      ui.settingsError.hidden = true;
    } catch (error) {
      ui.settingsError.textContent = error.message;
      ui.settingsError.hidden = false;
    }
  });
  $("key-save").addEventListener("click", saveKey);
  ui.keyInput.addEventListener("keydown", (event) => {
    if (event.key === "Enter") saveKey();
  });
  ui.keyButton.addEventListener("click", () => askForKey());
  ui.keyButton.hidden = AUTH === "none";

  writeSettings();
  renderAll();
  if (AUTH !== "none" && !credential()) askForKey();
  else ui.input.focus();
})();

// Outpost dashboard: a little plain JavaScript on top of server-rendered pages.
// Pages work without it; with it they update live from the event stream.
"use strict";

(function () {
  const csrf = () => document.querySelector('meta[name="csrf-token"]')?.content || "";

  // --- compose form: show the fields of the chosen timing kind; cron presets ---------------
  function setupTimingPicker(root) {
    const picker = root.querySelector("#timing-picker");
    if (!picker) return;
    const show = () => {
      const kind = picker.querySelector('input[name="timing_kind"]:checked')?.value || "cron";
      picker.querySelectorAll("[data-kind]").forEach((el) => el.classList.toggle("hidden", el.dataset.kind !== kind));
    };
    picker.querySelectorAll('input[name="timing_kind"]').forEach((r) => r.addEventListener("change", show));
    picker.querySelectorAll("[data-cron]").forEach((b) =>
      b.addEventListener("click", () => { picker.querySelector('input[name="expression"]').value = b.dataset.cron; }));
    show();
  }

  // --- Office task board: drag a card to a column, which calls the same /move as the API ----
  function setupBoard(root) {
    const board = root.querySelector("#board");
    if (!board) return;
    board.querySelectorAll(".card").forEach((card) => {
      card.addEventListener("dragstart", (e) => {
        e.dataTransfer.setData("text/plain", card.dataset.task);
        card.classList.add("dragging");
      });
      card.addEventListener("dragend", () => card.classList.remove("dragging"));
    });
    board.querySelectorAll(".column").forEach((column) => {
      column.addEventListener("dragover", (e) => { e.preventDefault(); column.classList.add("drop-target"); });
      column.addEventListener("dragleave", () => column.classList.remove("drop-target"));
      column.addEventListener("drop", async (e) => {
        e.preventDefault();
        column.classList.remove("drop-target");
        const task = e.dataTransfer.getData("text/plain");
        const card = document.getElementById("card-" + task);
        if (!task || !card || card.closest(".column") === column) return;
        column.appendChild(card);   // at once; the refresh below shows what the server made of it
        const reply = await fetch(`/api/office/tasks/${task}/move`, {
          method: "POST", credentials: "same-origin",
          headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf() },
          body: JSON.stringify({ state: column.dataset.state }),
        });
        if (!reply.ok) {
          const problem = await reply.json().catch(() => ({}));
          window.alert("Not moved: " + (problem.detail || reply.statusText));
        }
        refresh(true);
      });
    });
  }

  // --- tabs (run inspection): without JavaScript every panel shows, one under another --------
  function setupTabs(root) {
    const tabs = root.querySelectorAll(".tabs [data-tab]");
    if (!tabs.length) return;
    const show = (name) => {
      tabs.forEach((t) => t.classList.toggle("active", t.dataset.tab === name));
      root.querySelectorAll("[data-panel]").forEach((p) => p.classList.toggle("shown", p.dataset.panel === name));
    };
    tabs.forEach((t) => t.addEventListener("click", (e) => { e.preventDefault(); show(t.dataset.tab); }));
    show(location.hash.startsWith("#tab-") ? location.hash.slice(5) : "overview");
  }

  // --- times: a list's <time data-rel> reads "3 min ago", its exact instant in the viewer's
  // zone on hover (the server wrote it in UTC); a running run's [data-since] counts on. --------
  const pad = (n) => String(n).padStart(2, "0");
  function stamp(date, seconds) {
    return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
      `${pad(date.getHours())}:${pad(date.getMinutes())}` + (seconds ? `:${pad(date.getSeconds())}` : "");
  }
  function relative(iso, now = Date.now()) {
    const at = new Date(iso), s = (at.getTime() - now) / 1000, a = Math.abs(s);
    const say = (n, unit) => (s < 0 ? `${n} ${unit} ago` : `in ${n} ${unit}`);
    if (a < 45) return s < 0 ? "just now" : "in under a minute";
    if (a < 90 * 60) return say(Math.max(1, Math.round(a / 60)), "min");
    if (a < 36 * 3600) return say(Math.round(a / 3600), "h");
    if (a < 14 * 86400) { const d = Math.round(a / 86400); return say(d, d === 1 ? "day" : "days"); }
    return stamp(at);
  }
  function exact(iso) {
    const at = new Date(iso);
    const zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
    const short = new Intl.DateTimeFormat("en-US", { timeZoneName: "short" }).formatToParts(at)
      .find((p) => p.type === "timeZoneName")?.value;
    const named = short && short !== zone ? `${short} (${zone})` : zone;
    return `${stamp(at, true)} ${named} · ${at.toISOString().slice(0, 19).replace("T", " ")} UTC`;
  }
  function duration(seconds) {   // the server's words_of_seconds
    const s = Math.floor(seconds);
    if (s < 1) return "< 1 s";
    for (const [unit, size, small, smallSize] of [["d", 86400, "h", 3600], ["h", 3600, "m", 60], ["m", 60, "s", 1]]) {
      if (s >= size) {
        const rest = Math.floor((s % size) / smallSize);
        return `${Math.floor(s / size)} ${unit}` + (rest ? ` ${rest} ${small}` : "");
      }
    }
    return `${s} s`;
  }
  function renderTimes(root) {
    root.querySelectorAll("time[data-rel]").forEach((t) => {
      const iso = t.getAttribute("datetime");
      t.textContent = relative(iso);
      t.title = exact(iso);
    });
    renderRunning(root);
  }
  function renderRunning(root) {
    root.querySelectorAll("[data-since]").forEach((el) => {
      el.textContent = duration((Date.now() - Date.parse(el.dataset.since)) / 1000);
    });
  }

  // --- bulk actions: tick rows, act on the selection (a ticked row stops the live refresh) ----
  function setupBulk(root) {
    root.querySelectorAll("form[data-bulk]").forEach((form) => {
      const boxes = () => [...document.querySelectorAll(`input[name=ids][form="${form.id}"]`)];
      const all = document.querySelector(`input[data-bulk-all][form="${form.id}"]`);
      const count = form.querySelector("[data-bulk-count]");
      const update = () => {
        const n = boxes().filter((b) => b.checked).length;
        form.querySelectorAll("[data-bulk-button]").forEach((b) => { b.disabled = n === 0; });
        if (count) count.textContent = n ? `${n} selected` : count.dataset.idle || count.textContent;
      };
      if (count) count.dataset.idle = count.textContent;
      boxes().forEach((b) => b.addEventListener("change", update));
      all?.addEventListener("change", () => { boxes().forEach((b) => { b.checked = all.checked; }); update(); });
      update();
    });
  }

  // --- copy buttons: a "Copy" button beside each [data-copy] (an id, a branch, a command, a
  // webhook URL or its curl example). It copies the attribute's value, else the element's text;
  // its name says what: data-copy-label, else the fact (<dt>) or the column it sits in. Its
  // words are CSS content, so the text of the element it sits in stays the value alone. ------
  function copyStatus() {
    let live = document.getElementById("copy-status");
    if (!live) {
      live = Object.assign(document.createElement("span"), { id: "copy-status", className: "visually-hidden" });
      live.setAttribute("role", "status");
      document.body.append(live);
    }
    return live;
  }
  function copyByHand(text) {
    // No navigator.clipboard over plain http (a LAN address is no secure context): a selected textarea.
    const buffer = Object.assign(document.createElement("textarea"), { value: text, className: "copy-buffer" });
    buffer.setAttribute("readonly", "");
    buffer.setAttribute("aria-hidden", "true");
    const before = document.activeElement;
    document.body.append(buffer);
    buffer.select();
    let copied = false;
    try { copied = document.execCommand("copy"); } catch (_) { copied = false; }
    buffer.remove();
    before?.focus?.();
    return copied;
  }
  async function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try { await navigator.clipboard.writeText(text); return true; } catch (_) { /* refused: by hand below */ }
    }
    return copyByHand(text);
  }
  function copyLabel(el) {
    if (el.dataset.copyLabel) return el.dataset.copyLabel;
    const dd = el.closest("dd");
    const dt = dd?.previousElementSibling;
    if (dt?.tagName === "DT") return dt.textContent.trim().toLowerCase();
    const cell = el.closest("td[data-label]");
    return cell ? cell.dataset.label.toLowerCase() : "text";
  }
  function setupCopy(root) {
    root.querySelectorAll("[data-copy]").forEach((el) => {
      if (el.dataset.copyReady) return;
      el.dataset.copyReady = "1";
      const what = copyLabel(el);
      const button = Object.assign(document.createElement("button"), { type: "button", className: "copy-btn" });
      button.setAttribute("aria-label", `Copy ${what}`);
      button.addEventListener("click", async (e) => {
        e.preventDefault();
        const copied = await copyText(el.dataset.copy || el.textContent.trim());
        button.dataset.copied = copied ? "yes" : "no";
        copyStatus().textContent = copied ? `Copied ${what}` : `Could not copy ${what}: it is selected, press Ctrl+C`;
        if (!copied) window.getSelection()?.selectAllChildren(el);
        clearTimeout(button.copyTimer);
        button.copyTimer = setTimeout(() => { delete button.dataset.copied; }, 1600);
      });
      // beside a word or a block of its own (a link, a code, a pre); inside a cell, a fact or a heading
      const inline = getComputedStyle(el).display.startsWith("inline");
      if (inline || el.tagName === "PRE") el.after(button); else el.append(button);
    });
  }

  // --- keyboard shortcuts: "/" search, "g" then a letter to go somewhere, "?" lists them. Never
  // while typing in a field, never with Ctrl, Alt or Cmd (the browser's own shortcuts). ----------
  const GO = { s: ["/schedules", "Schedules"], r: ["/runs", "Runs"], a: ["/attention", "Attention"],
    u: ["/upcoming", "Upcoming"], o: ["/office", "Office"] };
  const SEARCH_HASH = "#search";
  function focusSearch() {
    const box = document.querySelector("input[data-search]");
    if (!box) return false;
    box.focus();
    box.select?.();
    return true;
  }
  function shortcutsDialog() {
    let dialog = document.getElementById("shortcuts");
    if (dialog) return dialog;
    dialog = Object.assign(document.createElement("dialog"), { id: "shortcuts", className: "shortcuts" });
    dialog.setAttribute("aria-labelledby", "shortcuts-title");
    const rows = [["/", "Search (the Runs page's search when this page has none)"],
      ...Object.entries(GO).map(([key, [, name]]) => [`g ${key}`, `Go to ${name}`]), ["?", "This list"], ["Esc", "Close it"]];
    const title = Object.assign(document.createElement("h2"), { id: "shortcuts-title", textContent: "Keyboard shortcuts" });
    const list = document.createElement("dl");
    for (const [keys, what] of rows) {
      const dt = document.createElement("dt");
      keys.split(" ").forEach((k, i) => {
        if (i) dt.append(" then ");
        dt.append(Object.assign(document.createElement("kbd"), { textContent: k }));
      });
      list.append(dt, Object.assign(document.createElement("dd"), { textContent: what }));
    }
    const note = Object.assign(document.createElement("p"), { className: "small muted",
      textContent: "They do nothing while you type in a field." });
    const close = Object.assign(document.createElement("button"), { type: "button", textContent: "Close" });
    close.addEventListener("click", () => dialog.close());
    dialog.append(title, list, note, close);
    document.body.append(dialog);
    return dialog;
  }
  function showShortcuts() {
    const dialog = shortcutsDialog();
    if (!dialog.open) dialog.showModal();   // modal: focus moves in, Esc closes it, focus returns
  }
  function typing(target) {
    return target instanceof Element && (target.isContentEditable || target.closest("input, textarea, select"));
  }
  function setupShortcuts() {
    if (!document.getElementById("shortcuts-hint")) return;   // signed out: nowhere to go
    document.getElementById("shortcuts-hint").addEventListener("click", showShortcuts);
    if (location.hash === SEARCH_HASH && focusSearch()) history.replaceState(null, "", location.pathname + location.search);
    let pendingG = 0;
    document.addEventListener("keydown", (e) => {
      if (["Shift", "Control", "Alt", "Meta", "AltGraph", "CapsLock"].includes(e.key)) return;   // on the way to a key
      if (e.defaultPrevented || e.ctrlKey || e.metaKey || e.altKey || e.isComposing || typing(e.target)) return;
      if (document.getElementById("shortcuts")?.open) return;   // the dialog has the keyboard (Esc, Tab)
      const gWasPressed = Date.now() - pendingG < 1500;
      pendingG = 0;
      if (gWasPressed && Object.hasOwn(GO, e.key)) {
        e.preventDefault();
        location.href = GO[e.key][0];
      } else if (e.key === "g") {
        pendingG = Date.now();
      } else if (e.key === "/") {
        e.preventDefault();
        if (!focusSearch()) location.href = "/runs" + SEARCH_HASH;
      } else if (e.key === "?") {
        e.preventDefault();
        showShortcuts();
      }
    });
  }

  // --- a run's log: the search box shows only the lines (and transcript entries) with its words,
  // the words marked; the query outlives a live refresh. The log is span.log-block elements, the
  // lines that began in the same second, that second in data-t (CSS draws it in a gutter, outside
  // the text); its lines, each with its second, are kept per element. ---------------------------
  let logQuery = "";
  const logLines = new WeakMap();
  function linesOf(log) {
    if (!logLines.has(log)) {
      logLines.set(log, [...log.querySelectorAll(":scope > .log-block")].flatMap((block) =>
        (block.textContent.match(/[^\n]*\n|[^\n]+$/g) || []).map((text) => ({ t: block.dataset.t || "", text }))));
    }
    return logLines.get(log);
  }
  function blocksOf(lines) {
    const blocks = [];
    for (const line of lines) {
      const last = blocks[blocks.length - 1];
      if (last && last.t === line.t) last.text += line.text;
      else blocks.push({ t: line.t, text: line.text });
    }
    return blocks;
  }
  function blockSpan(block, q) {
    const span = document.createElement("span");
    span.className = "log-block";
    if (block.t) span.dataset.t = block.t;
    const lower = block.text.toLowerCase();
    let at = 0;
    for (let i = q ? lower.indexOf(q) : -1; i >= 0; i = lower.indexOf(q, at)) {
      span.append(block.text.slice(at, i));
      const mark = document.createElement("mark");
      mark.textContent = block.text.slice(i, i + q.length);
      span.append(mark);
      at = i + q.length;
    }
    span.append(block.text.slice(at));
    return span;
  }
  function filterLog() {
    const q = logQuery.trim().toLowerCase();
    const log = document.getElementById("run-log");
    const count = document.getElementById("log-matches");
    if (log) {
      const lines = linesOf(log);
      const shown = q ? lines.filter((line) => line.text.toLowerCase().includes(q)) : blocksOf(lines);
      log.replaceChildren(...shown.map((block) => blockSpan(block, q)));
      if (count && q) count.textContent = `${shown.length} matching line${shown.length === 1 ? "" : "s"}`;
    }
    document.querySelectorAll("#run-transcript > li").forEach((entry) =>
      entry.classList.toggle("hidden", !!q && !entry.textContent.toLowerCase().includes(q)));
    if (count && !q) count.textContent = "";
  }
  // Output that arrives live is stamped when this page receives it (within the second it polls);
  // the page drawn again once the run settles shows the times the log kept.
  function clockIn(zone) {
    try {
      return new Intl.DateTimeFormat("en-GB", { timeZone: zone, hour: "2-digit", minute: "2-digit",
        second: "2-digit", hourCycle: "h23" }).format(new Date());
    } catch (e) {
      return "";
    }
  }
  function appendLog(log, text) {
    const lines = linesOf(log);
    const t = clockIn(log.dataset.tz || "UTC");
    let lastBlock = lines.length;   // where the last block drawn begins: it is drawn again
    while (lastBlock > 0 && lines[lastBlock - 1].t === lines[lines.length - 1].t) lastBlock -= 1;
    let rest = text;
    const last = lines[lines.length - 1];
    if (last && !last.text.endsWith("\n")) {   // the line it was in the middle of goes on
      const end = rest.indexOf("\n") + 1 || rest.length;
      last.text += rest.slice(0, end);
      rest = rest.slice(end);
    }
    for (const piece of rest.match(/[^\n]*\n|[^\n]+$/g) || []) lines.push({ t, text: piece });
    if (logQuery.trim()) {
      filterLog();
      return;
    }
    if (last) log.lastElementChild?.remove();
    log.append(...blocksOf(lines.slice(lastBlock)).map((block) => blockSpan(block, "")));
  }
  function setupLogSearch(root) {
    const box = root.querySelector("#log-search");
    if (!box) return;
    box.value = logQuery;
    box.addEventListener("input", () => { logQuery = box.value; filterLog(); });
    if (logQuery) filterLog();
  }

  // --- small behaviours: confirm before destructive actions, "back" keeps form input -------
  function setupPage(root) {
    setupBulk(root);
    const viewerZone = Intl.DateTimeFormat().resolvedOptions().timeZone;
    // a page grouped by day in a zone asks again in the viewer's when it was drawn in another
    const byZone = root.querySelector("[data-viewer-page]");
    if (byZone && viewerZone && byZone.dataset.zone !== viewerZone && !new URLSearchParams(location.search).has("tz")) {
      const url = new URL(location.href);
      url.searchParams.set("tz", viewerZone);
      location.replace(url);
    }
    root.querySelectorAll("input[data-viewer-zone]").forEach((i) => { if (!i.value && viewerZone) i.value = viewerZone; });
    renderTimes(root);
    setupLogSearch(root);
    setupTimingPicker(root);
    setupBoard(root);
    setupTabs(root);
    setupCopy(root);
    root.querySelectorAll("form.stack").forEach((f) => f.addEventListener("input", () => { f.dataset.dirty = "1"; }));
    root.querySelectorAll("button[data-confirm]").forEach((b) =>
      b.addEventListener("click", (e) => { if (!window.confirm(b.dataset.confirm)) e.preventDefault(); }));
    root.querySelectorAll("a[data-back]").forEach((a) =>
      a.addEventListener("click", (e) => { if (history.length > 1) { e.preventDefault(); history.back(); } }));
  }

  // --- live updates: the event stream refreshes pages that show live state -------------------
  let refreshTimer = null;
  async function refresh(always) {
    const main = document.getElementById("main");
    if (!main || (!main.dataset.live && !always)) return;
    // never wipe what is being typed or a selection being made, before the fetch or while it was on its way
    const busy = () => !always && main.querySelector("form[data-dirty], form :focus, input[name=ids]:checked");
    if (busy()) return;
    const reply = await fetch(location.href, { credentials: "same-origin", headers: { Accept: "text/html" } });
    if (!reply.ok || reply.redirected) return;
    const page = new DOMParser().parseFromString(await reply.text(), "text/html");
    const fresh = page.getElementById("main");
    if (!fresh || busy()) return;
    const searching = document.activeElement?.id === "log-search";   // typing in it goes on
    main.innerHTML = fresh.innerHTML;
    main.dataset.live = fresh.dataset.live || "";
    const count = page.getElementById("attention-count");
    const mine = document.getElementById("attention-count");
    if (count && mine) { mine.textContent = count.textContent; mine.className = count.className; }
    setupPage(main);
    const box = searching && document.getElementById("log-search");
    if (box) { box.focus(); box.setSelectionRange(box.value.length, box.value.length); }
    followLog();
  }
  function scheduleRefresh() {
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(refresh, 250);
  }

  function notify(event) {
    if (!("Notification" in window) || Notification.permission !== "granted") return;
    const data = JSON.parse(event.data).data || {};
    const note = new Notification("Outpost: " + (data.title || "attention"), { tag: data.attention_id });
    note.onclick = () => { window.focus(); location.href = "/attention"; };
  }

  function connect() {
    if (!document.getElementById("attention-count") || !window.EventSource) return;
    const dot = document.getElementById("live-dot");
    // EventSource reconnects by itself (the server says retry: 2000) and resumes after the
    // last event id it saw, so a daemon restart loses nothing.
    const source = new EventSource("/v1/outpost/events/stream?after=" + (document.body.dataset.cursor || "0"));
    source.onopen = () => dot?.classList.add("on");
    source.onerror = () => dot?.classList.remove("on");
    source.onmessage = scheduleRefresh;
    ["schedule.created", "schedule.updated", "schedule.controlled", "occurrence.claimed", "occurrence.skipped",
      "run.queued", "run.started", "run.controlled", "run.resumed", "run.settled", "attention.raised",
      "attention.acknowledged", "attention.folded", "agent.created", "agent.updated", "task.created", "task.updated", "task.moved",
      "comment.created", "approval.requested", "approval.resolved", "wakeup.queued", "wakeup.coalesced",
      "wakeup.claimed", "wakeup.ended", "wakeup.retry_scheduled", "office.activity"
    ].forEach((type) => source.addEventListener(type, scheduleRefresh));
    source.addEventListener("attention.raised", notify);
  }

  function setupNotifications() {
    const button = document.getElementById("enable-notifications");
    if (!button || !("Notification" in window) || Notification.permission !== "default") return;
    button.classList.remove("hidden");
    button.addEventListener("click", async () => {
      await Notification.requestPermission();
      button.classList.add("hidden");
    });
  }

  // --- the live log of a running run ------------------------------------------------------------
  let following = false;
  async function followLog() {
    if (following) return;
    following = true;
    try {
      for (;;) {
        const log = document.getElementById("run-log");
        if (!log || !log.dataset.following) return;
        const reply = await fetch(`/v1/outpost/runs/${log.dataset.run}/log?offset=${log.dataset.offset || 0}`,
          { credentials: "same-origin" });
        if (reply.ok) {
          const text = await reply.text();
          const size = reply.headers.get("X-Log-Size");
          const current = document.getElementById("run-log");
          if (current === log && text) {
            const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 20;
            appendLog(log, text);
            document.getElementById("log-empty")?.remove();
            if (atBottom) log.scrollTop = log.scrollHeight;
          }
          if (current === log && size) log.dataset.offset = size;
        }
        await new Promise((resolve) => setTimeout(resolve, 1000));
      }
    } finally {
      following = false;
    }
  }

  window.outpost = { csrf, refresh, relative, duration };
  document.documentElement.classList.add("js");
  document.addEventListener("DOMContentLoaded", () => {
    setupPage(document);
    setInterval(() => renderTimes(document), 30000);
    setInterval(() => renderRunning(document), 1000);
    setupNotifications();
    setupShortcuts();
    connect();
    followLog();
  });
})();

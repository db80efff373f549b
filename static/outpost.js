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

  // --- small behaviours: confirm before destructive actions, "back" keeps form input -------
  function setupPage(root) {
    setupTimingPicker(root);
    root.querySelectorAll("button[data-confirm]").forEach((b) =>
      b.addEventListener("click", (e) => { if (!window.confirm(b.dataset.confirm)) e.preventDefault(); }));
    root.querySelectorAll("a[data-back]").forEach((a) =>
      a.addEventListener("click", (e) => { if (history.length > 1) { e.preventDefault(); history.back(); } }));
  }

  // --- live updates: the event stream refreshes pages that show live state -------------------
  let refreshTimer = null;
  async function refresh() {
    const main = document.getElementById("main");
    if (!main || !main.dataset.live) return;
    const reply = await fetch(location.href, { credentials: "same-origin", headers: { Accept: "text/html" } });
    if (!reply.ok || reply.redirected) return;
    const page = new DOMParser().parseFromString(await reply.text(), "text/html");
    const fresh = page.getElementById("main");
    if (!fresh) return;
    main.innerHTML = fresh.innerHTML;
    main.dataset.live = fresh.dataset.live || "";
    const count = page.getElementById("attention-count");
    const mine = document.getElementById("attention-count");
    if (count && mine) { mine.textContent = count.textContent; mine.className = count.className; }
    setupPage(main);
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
      "attention.acknowledged"].forEach((type) => source.addEventListener(type, scheduleRefresh));
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
            log.textContent += text;
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

  window.outpost = { csrf, refresh };
  document.addEventListener("DOMContentLoaded", () => {
    setupPage(document);
    setupNotifications();
    connect();
    followLog();
  });
})();

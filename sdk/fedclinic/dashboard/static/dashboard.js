// fedclinic dashboard: polls the server's two JSON routes and places the HTML fragments it renders (escaped there).
// Read-only: it only ever sends GET requests, each with the launch token.
"use strict";
(function () {
  const token = new URLSearchParams(location.search).get("token") || "";
  const pollMs = Number(document.body.dataset.pollMs) || 2000;
  const status = document.getElementById("status");
  const shown = {};  // section id -> the fragment placed last (unchanged ones are left alone: open <details> stay open)
  let selected = decodeURIComponent(location.hash.slice(1));
  let busy = false;
  let polls = 0;

  async function get(path) {
    const answer = await fetch(path, {headers: {"X-Fedclinic-Token": token}, cache: "no-store"});
    const doc = await answer.json().catch(() => ({error: "HTTP " + answer.status}));
    if (!answer.ok) throw new Error(doc.error || "HTTP " + answer.status);
    return doc;
  }

  function place(id, fragment) {
    if (shown[id] === fragment) return;
    const element = document.getElementById(id);
    if (element) element.innerHTML = fragment;
    shown[id] = fragment;
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    try {
      const list = await get("/api/tasks?selected=" + encodeURIComponent(selected));
      if (!selected && list.tasks.length) selected = list.tasks[0].task_id;  // the most recently updated
      place("tasks", list.html);
      if (selected) {
        const doc = await get("/api/tasks/" + encodeURIComponent(selected));
        for (const [id, fragment] of Object.entries(doc.html)) place(id, fragment);
        document.body.dataset.task = selected;
        document.body.dataset.state = doc.task.state;
      }
      polls += 1;
      document.body.dataset.polls = String(polls);
      status.textContent = "updated " + new Date().toLocaleTimeString();
      status.className = "status ok";
    } catch (error) {
      status.textContent = String(error.message || error);
      status.className = "status error";
    } finally {
      busy = false;
    }
  }

  window.addEventListener("hashchange", function () {
    selected = decodeURIComponent(location.hash.slice(1));
    refresh();
  });
  refresh();
  setInterval(refresh, pollMs);
})();

// The console's only script (served inline, allowed by its hash in the page's CSP): streams a
// run's output into the page, sends the interrupt and upload forms without leaving the page.
(function () {
  "use strict";
  var out = document.getElementById("live-output");
  var state = document.getElementById("run-state");
  var runForm = document.getElementById("run-form");
  var stopForm = document.getElementById("interrupt-form");
  var uploadForm = document.getElementById("upload-form");
  var streams = {};

  function say(text) { if (state) { state.textContent = text; } }
  function append(kind, text) {
    if (!streams[kind]) {
      streams[kind] = document.createElement("pre");
      streams[kind].className = kind;
      out.appendChild(streams[kind]);
    }
    streams[kind].textContent += text;
  }
  function image(b64) {
    if (!/^[A-Za-z0-9+\/=]*$/.test(b64)) { return; }
    var img = document.createElement("img");
    img.alt = "chart";
    img.src = "data:image/png;base64," + b64;
    out.appendChild(img);
  }
  async function refusal(response) {
    var text = await response.text();
    var page = new DOMParser().parseFromString(text, "text/html");
    var error = page.querySelector(".error");
    return "Refused (HTTP " + response.status + "): " + (error ? error.textContent : "");
  }
  function handle(block) {
    var event = "message", data = [];
    block.split("\n").forEach(function (line) {
      if (line.indexOf("event:") === 0) { event = line.slice(6).trim(); }
      else if (line.indexOf("data:") === 0) { data.push(line.slice(5).replace(/^ /, "")); }
    });
    var text = data.join("\n");
    if (event === "stdout" || event === "stderr") { append(event, text); }
    else if (event === "display") { image(text); }
    else if (event === "started") { say("running in " + text); }
    else if (event === "done") { say(text); }
  }
  function post(form) {
    return fetch(form.action, {
      method: "POST",
      body: new URLSearchParams(new FormData(form)),
      credentials: "same-origin",
    });
  }

  if (runForm) {
    runForm.addEventListener("submit", async function (e) {
      e.preventDefault();
      out.textContent = "";
      out.hidden = false;
      streams = {};
      say("starting…");
      var response = await post(runForm);
      if (!response.ok || !response.body) { say(await refusal(response)); return; }
      var reader = response.body.getReader(), decoder = new TextDecoder(), buffer = "";
      for (;;) {
        var chunk = await reader.read();
        if (chunk.done) { break; }
        buffer += decoder.decode(chunk.value, { stream: true });
        var at;
        while ((at = buffer.indexOf("\n\n")) >= 0) {
          handle(buffer.slice(0, at));
          buffer = buffer.slice(at + 2);
        }
      }
      document.getElementById("reload").hidden = false;
    });
  }
  if (stopForm) {
    stopForm.addEventListener("submit", async function (e) {
      e.preventDefault();
      var response = await post(stopForm);
      if (!response.ok) { say(await refusal(response)); }
    });
  }
  if (uploadForm) {
    uploadForm.addEventListener("submit", async function (e) {
      e.preventDefault();
      var file = document.getElementById("upload-file").files[0];
      if (!file) { return; }
      var url = uploadForm.action + "&name=" + encodeURIComponent(file.name);
      var csrf = uploadForm.querySelector("input[name=csrf]").value;
      var response = await fetch(url, {
        method: "POST", body: file, credentials: "same-origin",
        headers: { "x-sandgate-csrf": csrf, "content-type": "application/octet-stream" },
      });
      if (!response.ok) { say(await refusal(response)); return; }
      location.reload();
    });
  }
})();

// Keyboard: ← / → open the previous / next key (on a key page), unless typing in a field.
document.addEventListener("keydown", function (event) {
  var target = event.target;
  if (event.altKey || event.ctrlKey || event.metaKey || event.shiftKey) return;
  if (target && (target.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(target.tagName))) return;
  var link = null;
  if (event.key === "ArrowLeft") link = document.getElementById("previous-key");
  if (event.key === "ArrowRight") link = document.getElementById("next-key");
  if (link) { event.preventDefault(); window.location.href = link.href; }
});

// An error answer to an htmx request is a short message (ffmem/web/rendering.py render_error,
// X-Error-Message): it goes next to the field that caused it when the page has a place for it
// (#FIELD-error), else just before the element the answer was going to (errorSlot); that element is never
// replaced, so every later request still finds it. A new request clears its form's and target's messages.
function errorSlot(target) {
  var before = target.previousElementSibling;
  if (before && before.classList.contains("request-error")) return before;
  var slot = document.createElement("p");
  slot.className = "request-error";
  slot.setAttribute("role", "alert");
  if (target.id) slot.id = target.id + "-request-error";
  target.insertAdjacentElement("beforebegin", slot);
  return slot;
}
// Results that no longer answer the form (data-stale-on-error) are dimmed until the next answer.
function markStale(target) {
  if (target && target.hasAttribute("data-stale-on-error")) target.classList.add("stale");
}
document.addEventListener("htmx:beforeSwap", function (event) {
  var detail = event.detail;
  if (!detail.isError || !detail.xhr.getResponseHeader("X-Error-Message")) return;
  var field = detail.xhr.getResponseHeader("X-Error-Field");
  var target = detail.target;
  var slot = field ? document.getElementById(field + "-error") : null;
  if (!slot && target) slot = errorSlot(target === document.body ? document.querySelector("main") : target);
  if (!slot) return;
  markStale(target);
  detail.target = slot;
  detail.swapOverride = "innerHTML";
  detail.selectOverride = "unset";  // the whole message, whatever the element selects from an answer (hx-select)
  detail.isError = false;  // shown where it belongs: htmx need not log it again as a console error
});
// No answer at all (the network failed, the request timed out): said just before the element it was for.
function noAnswer(message) {
  return function (event) {
    var target = event.detail.target;
    if (!target || !target.isConnected) return;
    markStale(target);
    errorSlot(target === document.body ? document.querySelector("main") : target).textContent = message;
  };
}
document.addEventListener("htmx:sendError", noAnswer("No answer: the server could not be reached. Try again."));
document.addEventListener("htmx:timeout", noAnswer("No answer: the server took too long. Try again."));
// A file input refuses a file larger than the server accepts (data-max-bytes), before it is sent.
document.addEventListener("change", function (event) {
  var input = event.target;
  if (!input.matches || !input.matches("input[type=file][data-max-bytes]")) return;
  var limit = Number(input.dataset.maxBytes);
  var file = input.files && input.files[0];
  var slot = document.getElementById(input.id + "-error");
  var message = file && file.size > limit
    ? file.name + " is " + file.size.toLocaleString() + " bytes; this server accepts at most " + limit.toLocaleString() + "."
    : "";
  input.setCustomValidity(message);
  if (slot) slot.textContent = message;
});
document.addEventListener("htmx:beforeRequest", function (event) {
  var form = event.detail.elt.closest ? event.detail.elt.closest("form") : null;
  if (form) form.querySelectorAll(".field-error").forEach(function (slot) { slot.textContent = ""; });
  var target = event.detail.target;
  var before = target && target.previousElementSibling;
  if (before && before.classList.contains("request-error")) before.textContent = "";
});
// Busy while an htmx request runs: the element it will answer into (dimmed by app.css) and the form or
// element that asked carry aria-busy, so the wait shows (a first token search can take seconds). Not
// for a section that polls itself (hx-trigger="every 1s"): it would blink. The elements marked are kept per
// request: an error answer goes to its message slot (detail.target changes), and htmx:afterRequest comes
// after every answer (success, error, network failure, timeout, abort), so busy always ends.
var busyMarks = new WeakMap();  // the request's XMLHttpRequest → the elements it marked busy
document.addEventListener("htmx:beforeRequest", function (event) {
  var detail = event.detail;
  if (/^every /.test(detail.elt.getAttribute ? detail.elt.getAttribute("hx-trigger") || "" : "")) return;
  var marked = [detail.target, detail.elt].filter(function (element) { return element && element.setAttribute; });
  marked.forEach(function (element) { element.setAttribute("aria-busy", "true"); });
  busyMarks.set(detail.xhr, marked);
});
document.addEventListener("htmx:afterRequest", function (event) {
  (busyMarks.get(event.detail.xhr) || []).forEach(function (element) { element.removeAttribute("aria-busy"); });
  busyMarks.delete(event.detail.xhr);
});
// A field marked data-omit-empty stays out of the URL while it is empty (the live view's target: empty
// means the default, the prediction, and `target=` is refused), for a plain submit and for htmx alike.
document.addEventListener("formdata", function (event) {
  event.target.querySelectorAll("[data-omit-empty]").forEach(function (input) {
    if (input.name && input.value === "") event.formData.delete(input.name);
  });
});
document.addEventListener("htmx:configRequest", function (event) {
  var form = event.detail.elt.closest ? event.detail.elt.closest("form") : null;
  if (!form) return;
  form.querySelectorAll("[data-omit-empty]").forEach(function (input) {
    if (input.name && input.value === "") delete event.detail.parameters[input.name];
  });
});
// A request whose URL would be longer than the server accepts (data-max-query, bytes, on an element
// around it: the live view, a key page's text box) goes as a form (POST) with the same fields: a long
// prompt works and keeps its page; shorter ones stay GETs, their URL the share link.
document.addEventListener("htmx:configRequest", function (event) {
  var detail = event.detail;
  var box = detail.elt.closest ? detail.elt.closest("[data-max-query]") : null;
  if (!box || detail.verb !== "get") return;
  var url = new URL(detail.path, location.href);
  var fields = url.search ? [url.search.slice(1)] : [];
  detail.formData.forEach(function (value, name) {
    fields.push(encodeURIComponent(name) + "=" + encodeURIComponent(value));  // as htmx writes the URL
  });
  if (fields.join("&").length <= Number(box.dataset.maxQuery)) return;
  url.searchParams.forEach(function (value, name) { detail.formData.append(name, value); });
  detail.path = url.pathname;
  detail.verb = "post";
  detail.useUrlParams = false;
  detail.headers["Content-Type"] = "application/x-www-form-urlencoded";
});

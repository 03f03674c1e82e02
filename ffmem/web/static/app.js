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

// An error answer to an htmx request is a short message (ffmem/web/rendering.py render_error): it goes
// next to the field that caused it when the page has a place for it (#FIELD-error), the rest of the page
// kept; otherwise where the answer was going. A new request clears its form's old messages.
document.addEventListener("htmx:beforeSwap", function (event) {
  if (!event.detail.isError) return;
  var field = event.detail.xhr.getResponseHeader("X-Error-Field");
  var slot = field ? document.getElementById(field + "-error") : null;
  if (slot) {
    // Results that no longer answer the form (data-stale-on-error) are dimmed until the next answer.
    var stale = event.detail.target;
    if (stale && stale.hasAttribute("data-stale-on-error")) stale.classList.add("stale");
    event.detail.target = slot;
    event.detail.swapOverride = "innerHTML";
  }
});
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

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

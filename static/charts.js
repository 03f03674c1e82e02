// Draw every plotly figure spec found in a `.chart[data-figure]` element (also after htmx swaps).
(function () {
  function draw(root) {
    if (!window.Plotly) return;
    root.querySelectorAll(".chart[data-figure]").forEach(function (el) {
      if (el.dataset.drawn) return;
      var figure = JSON.parse(el.dataset.figure);
      window.Plotly.newPlot(el, figure.data, figure.layout, { displayModeBar: false, responsive: true });
      el.dataset.drawn = "1";
    });
  }
  window.addEventListener("load", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (event) { draw(event.target); });
})();

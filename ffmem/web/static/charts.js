// Draw every plotly figure spec found in a `.chart[data-figure]` element (also after htmx swaps).
(function () {
  function draw(root) {
    if (!window.Plotly) return;
    root.querySelectorAll(".chart[data-figure]").forEach(function (el) {
      if (el.dataset.drawn) return;
      var figure = JSON.parse(el.dataset.figure);
      window.Plotly.newPlot(el, figure.data, figure.layout, { displayModeBar: false, responsive: true });
      el.dataset.drawn = "1";
      if (figure.layout.meta && figure.layout.meta.links) {
        // A figure whose points are links (the weight graph): a click opens the point's customdata[0].
        el.on("plotly_click", function (data) {
          var point = data.points && data.points[0];
          var url = point && Array.isArray(point.customdata) ? point.customdata[0] : null;
          if (typeof url === "string" && url.charAt(0) === "/") window.location.assign(url);
        });
      }
      if (el.id === "trace-heatmap") {
        // A click on a column selects that position: the same as clicking its token chip.
        el.on("plotly_click", function (data) {
          var point = data.points && data.points[0];
          var column = point && Array.isArray(point.pointIndex) ? point.pointIndex[1] : null;
          var chip = column === null ? null : document.getElementById("token-" + column);
          if (chip) chip.click();
        });
      }
    });
  }
  window.addEventListener("load", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (event) { draw(event.target); });
})();

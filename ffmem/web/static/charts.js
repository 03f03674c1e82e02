// Draw every plotly figure spec found in a `.chart[data-figure]` element (also after htmx swaps).
(function () {
  var HEATMAP = "heatmap"; // the live view's query parameter that keeps the heatmap's mode (pages/trace_charts.py HEATMAP_MODES)

  // A figure with `layout.meta.declutter` (the circuit): an x-axis label or a node's name that would cover one
  // already shown, or leave the chart, is hidden: the axis left to right, then the names in their trace's
  // order (the strongest first). Redone after every redraw (a resize), each label shown again first.
  function overlap(a, b) {
    return a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  }
  function declutter(el) {
    var svg = el.querySelector(".main-svg");
    if (!svg) return;
    var chart = svg.getBoundingClientRect();
    var shown = [];
    el.querySelectorAll(".xtick text, .textpoint text").forEach(function (text) {
      text.style.display = "";
      var box = text.getBoundingClientRect();
      if (box.width === 0 || box.height === 0) return; // an unnamed node
      var inside = box.left >= chart.left && box.right <= chart.right && box.top >= chart.top && box.bottom <= chart.bottom;
      if (!inside || shown.some(function (other) { return overlap(box, other); })) text.style.display = "none";
      else shown.push(box);
    });
  }

  function draw(root) {
    if (!window.Plotly) return;
    root.querySelectorAll(".chart[data-figure]").forEach(function (el) {
      if (el.dataset.drawn) return;
      var figure = JSON.parse(el.dataset.figure);
      var plotted = window.Plotly.newPlot(el, figure.data, figure.layout, { displayModeBar: false, responsive: true });
      el.dataset.drawn = "1";
      if (figure.layout.meta && figure.layout.meta.declutter) {
        plotted.then(function () {
          declutter(el);
          el.on("plotly_afterplot", function () { declutter(el); });
        });
      }
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
        // A mode button puts the mode in the URL (the first mode is the default: no parameter).
        var modes = (figure.layout.meta && figure.layout.meta.modes) || [];
        el.on("plotly_buttonclicked", function (data) {
          var url = new URL(window.location.href);
          if (data.active > 0 && modes[data.active]) url.searchParams.set(HEATMAP, modes[data.active]);
          else url.searchParams.delete(HEATMAP);
          window.history.replaceState(window.history.state, "", url.toString());
        });
      }
    });
  }

  // Every request that swaps the live view (a chip, an edit link, the form) asks for the mode shown now.
  document.addEventListener("htmx:configRequest", function (event) {
    var target = event.detail.target;
    var mode = new URL(window.location.href).searchParams.get(HEATMAP);
    if (target && target.id === "trace" && mode) event.detail.parameters[HEATMAP] = mode;
  });
  window.addEventListener("load", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function (event) { draw(event.target); });
})();

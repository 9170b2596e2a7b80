// The dashboard's charts and a live page's refresh (services/dashboard/templates/base.html loads it).
//
// Charts: the page's <script id="chart-data"> holds each chart's lines (services/dashboard/views.py,
// charts()); uPlot (vendor/uplot/) draws them into the element "chart-<id>". Hovering shows the
// values under the cursor in the chart's legend, a drag zooms, a double click resets, and the
// smoothing slider draws an exponential moving average of the lines marked `smooth`.
// A live page (<body data-refresh-s>) reads itself again every few seconds: the elements marked
// data-live are replaced, and the charts are given the new points (a zoomed chart stays zoomed).
"use strict";
(function () {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"];
  const plots = {}; // chart id -> {spec, plot}
  let smoothing = 0;

  function ema(ys, a) {
    if (!a) return ys;
    let s = null;
    return ys.map((y) => (y == null ? y : (s = s == null ? y : a * s + (1 - a) * y)));
  }

  function fmt(v) {
    if (v == null) return "";
    const m = Math.abs(v);
    return m >= 1e4 || (m > 0 && m < 1e-3) ? v.toExponential(2) : String(+v.toPrecision(4));
  }

  // one x array for all lines (uPlot.join: a line has no value where another has a point)
  function aligned(spec) {
    const data = uPlot.join(spec.series.map((s) => [s.xs, s.ys]));
    return [data[0], ...data.slice(1).map((ys, i) => (spec.series[i].smooth ? ema(ys, smoothing) : ys))];
  }

  // each engine's update pauses, shaded in its colour under the lines
  function drawBands(u, holder) {
    const { ctx } = u, { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();
    holder.spec.series.forEach((s, i) => {
      ctx.fillStyle = COLORS[i % COLORS.length] + "30";
      for (const [a, b] of s.bands || []) {
        const x0 = u.valToPos(a, "x", true), x1 = u.valToPos(b, "x", true);
        ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
      }
    });
    ctx.restore();
  }

  function options(holder) {
    const spec = holder.spec;
    const series = [{ label: spec.x }];
    spec.series.forEach((s, i) => {
      const line = { label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
                     value: (u, v) => fmt(v) };
      if (s.dash) line.dash = [4, 3];
      if (s.stepped) line.paths = uPlot.paths.stepped({ align: 1 });
      if (s.points) line.points = { show: true, size: 5 };
      series.push(line);
    });
    return {
      title: spec.title, width: 560, height: 240, series,
      scales: { x: { time: spec.time } },
      axes: [{ label: spec.x }, { label: spec.y, size: 60, values: (u, vals) => vals.map(fmt) }],
      cursor: { drag: { x: true, y: false } },
      hooks: { drawClear: [(u) => drawBands(u, holder)] },
    };
  }

  function draw(specs) {
    for (const spec of specs) {
      const el = document.getElementById("chart-" + spec.id);
      const held = plots[spec.id];
      if (!el) continue;
      if (!spec.series.length) {
        if (held) held.plot.destroy();
        delete plots[spec.id];
        el.innerHTML = "";
        const p = el.appendChild(document.createElement("p"));
        p.className = "empty";
        p.textContent = spec.title + ": " + spec.empty;
        continue;
      }
      const labels = (sp) => sp.series.map((s) => s.label).join("\n");
      if (held && labels(held.spec) === labels(spec)) {
        const xs = held.plot.data[0], x = held.plot.scales.x;
        const whole = !xs.length || (x.min <= xs[0] && x.max >= xs[xs.length - 1]);
        held.spec = spec;
        held.plot.setData(aligned(spec), whole); // zoomed in: stays where it is
        continue;
      }
      if (held) held.plot.destroy();
      el.innerHTML = "";
      const holder = { spec };
      holder.plot = new uPlot(options(holder), aligned(spec), el);
      plots[spec.id] = holder;
    }
  }

  async function refresh() {
    try {
      const r = await fetch(location.href, { credentials: "same-origin", cache: "no-store" });
      if (!r.ok || r.redirected) return;
      const page = new DOMParser().parseFromString(await r.text(), "text/html");
      for (const el of page.querySelectorAll("[data-live]")) {
        const here = document.getElementById(el.id);
        if (here) here.replaceWith(document.importNode(el, true));
      }
      const data = page.getElementById("chart-data");
      if (data) draw(JSON.parse(data.textContent));
    } catch (e) {
      // the server away for a moment (or the run ended): the next refresh tries again
    }
  }

  const data = document.getElementById("chart-data");
  if (data) draw(JSON.parse(data.textContent));
  const slider = document.getElementById("smoothing");
  if (slider) {
    slider.addEventListener("input", () => {
      smoothing = +slider.value;
      document.getElementById("smoothing-value").textContent = smoothing.toFixed(2);
      for (const held of Object.values(plots)) held.plot.setData(aligned(held.spec), false);
    });
  }
  const every = +document.body.dataset.refreshS;
  if (every) setInterval(refresh, every * 1000);
})();

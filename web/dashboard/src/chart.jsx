// A time-series chart: uPlot on a canvas, redrawn in place as samples come.
import { useEffect, useRef } from 'preact/hooks';
import uPlot from 'uplot';
import 'uplot/dist/uPlot.min.css';

export function Chart({ title, unit, times, values, color, testid }) {
  const box = useRef(null);
  const plot = useRef(null);

  useEffect(() => {
    const width = Math.max(320, (box.current.clientWidth || 600) - 8);
    plot.current = new uPlot(
      {
        width,
        height: 200,
        legend: { show: false },
        scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(max * 1.2, unit === '%' ? 5 : 1)] } },
        axes: [{}, { size: 60, values: (u, ticks) => ticks.map((v) => fmt(v) + (unit === '%' ? '%' : '')) }],
        series: [
          {},
          {
            label: title,
            stroke: color,
            width: 2,
            fill: color + '22',
            // With few samples (one, before the control plane keeps a
            // series) a line is invisible: draw the points.
            points: { show: true, size: 6, fill: color },
          },
        ],
      },
      [times, values],
      box.current,
    );
    return () => plot.current.destroy();
  }, []);

  useEffect(() => {
    if (plot.current) plot.current.setData([times, values]);
  }, [times, values]);

  const last = values.length ? values[values.length - 1] : null;
  return (
    <figure class="chart" data-testid={testid} data-points={values.length}>
      <figcaption>
        {title}
        <span class="now">{last === null ? 'no samples yet' : fmt(last) + ' ' + unit}</span>
      </figcaption>
      <div ref={box} class="plot" />
    </figure>
  );
}

function fmt(v) {
  if (v === null || v === undefined) return '';
  return Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1);
}

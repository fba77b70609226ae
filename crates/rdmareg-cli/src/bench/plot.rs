//! A small SVG line chart for the benchmark report: message size on a log2
//! x-axis, one line per series, log10 y-axis. Hand-written because the chart
//! is simple and a plotting crate would dominate the CLI's build time.

use std::fmt::Write as _;

/// One line of the chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend label.
    pub label: String,
    /// CSS colour.
    pub colour: &'static str,
    /// `(message size in bytes, value)` points; non-positive values are
    /// skipped (they cannot sit on a log axis).
    pub points: Vec<(u64, f64)>,
}

/// One chart.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Title above the chart.
    pub title: String,
    /// Y-axis label.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

const WIDTH: f64 = 640.0;
const HEIGHT: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// Render charts stacked vertically into one SVG document.
pub fn render(charts: &[Chart]) -> String {
    let total_height = HEIGHT * charts.len().max(1) as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{total_height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    for (index, chart) in charts.iter().enumerate() {
        render_chart(&mut svg, chart, index as f64 * HEIGHT);
    }
    svg.push_str("</svg>\n");
    svg
}

fn render_chart(svg: &mut String, chart: &Chart, y_offset: f64) {
    let points = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter())
        .filter(|(size, value)| *size > 0 && *value > 0.0);
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(size, value) in points {
        let x = (size as f64).log2();
        let y = value.log10();
        x_min = x_min.min(x);
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
        LEFT,
        y_offset + 22.0,
        escape(&chart.title)
    );
    if x_min > x_max {
        return;
    }
    y_min = y_min.floor();
    y_max = y_max.ceil().max(y_min + 1.0);
    if x_max - x_min < 1.0 {
        x_max = x_min + 1.0;
    }
    let plot_width = WIDTH - LEFT - RIGHT;
    let plot_height = HEIGHT - TOP - BOTTOM;
    let to_x = |size: u64| LEFT + ((size as f64).log2() - x_min) / (x_max - x_min) * plot_width;
    let to_y = |value: f64| {
        y_offset + TOP + plot_height - (value.log10() - y_min) / (y_max - y_min) * plot_height
    };
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{}" width="{plot_width}" height="{plot_height}" fill="none" stroke="#888"/>"##,
        y_offset + TOP
    );
    let mut decade = y_min as i32;
    while f64::from(decade) <= y_max {
        let value = 10f64.powi(decade);
        let y = to_y(value);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            LEFT + plot_width,
            LEFT - 6.0,
            y + 4.0,
            format_value(value)
        );
        decade += 1;
    }
    let mut exponent = x_min.ceil() as u32;
    while f64::from(exponent) <= x_max {
        if exponent % 4 == 3 || exponent == x_min.ceil() as u32 {
            let size = 1u64 << exponent;
            let x = to_x(size);
            let _ = writeln!(
                svg,
                r#"<text x="{x}" y="{}" text-anchor="middle">{}</text>"#,
                y_offset + TOP + plot_height + 16.0,
                format_size(size)
            );
        }
        exponent += 1;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">message size</text>"#,
        LEFT + plot_width / 2.0,
        y_offset + HEIGHT - 12.0
    );
    let _ = writeln!(
        svg,
        r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{}</text>"#,
        y_offset + TOP + plot_height / 2.0,
        y_offset + TOP + plot_height / 2.0,
        escape(&chart.y_label)
    );
    for (index, series) in chart.series.iter().enumerate() {
        let path: Vec<String> = series
            .points
            .iter()
            .filter(|(size, value)| *size > 0 && *value > 0.0)
            .map(|&(size, value)| format!("{:.1},{:.1}", to_x(size), to_y(value)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            series.colour,
            path.join(" ")
        );
        let legend_y = y_offset + TOP + 14.0 + index as f64 * 16.0;
        let legend_x = LEFT + plot_width + 12.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{legend_x}" x2="{}" y1="{legend_y}" y2="{legend_y}" stroke="{}" stroke-width="2"/><text x="{}" y="{}">{}</text>"#,
            legend_x + 18.0,
            series.colour,
            legend_x + 22.0,
            legend_y + 4.0,
            escape(&series.label)
        );
    }
}

/// `4096` → `4 KiB`.
pub fn format_size(size: u64) -> String {
    match size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{} GiB", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn format_value(value: f64) -> String {
    if value >= 1.0 {
        format!("{value:.0}")
    } else {
        format!("{value}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_printed_in_binary_units() {
        assert_eq!(format_size(8), "8 B");
        assert_eq!(format_size(4096), "4 KiB");
        assert_eq!(format_size(64 << 20), "64 MiB");
        assert_eq!(format_size(1000), "1000 B");
    }

    #[test]
    fn a_chart_has_one_polyline_per_series_and_escapes_labels() {
        let chart = Chart {
            title: "GET <latency>".into(),
            y_label: "µs".into(),
            series: vec![
                Series {
                    label: "rdmareg".into(),
                    colour: "red",
                    points: vec![(8, 2.0), (4096, 3.0)],
                },
                Series {
                    label: "ucx_perftest".into(),
                    colour: "blue",
                    points: vec![(8, 1.5), (4096, 2.5), (8192, 0.0)],
                },
            ],
        };
        let svg = render(&[chart]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("GET &lt;latency&gt;"));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}

//! The monitoring files of `deploy/monitoring/` as the tests read them: every query of the
//! Grafana dashboard, with its template variables replaced as Grafana would replace them for
//! "All" over a short time range, ready for a Prometheus instant query.

use std::path::{Path, PathBuf};

use crate::{Result, RigError};

/// `deploy/monitoring/` of this source tree.
pub fn deploy_monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring")
}

/// What `$__rate_interval` (and `$__interval`) stand for in the tests: Grafana makes it at least
/// four scrape intervals; a minute holds every sample of a short test run at a 1 s scrape, so a
/// rate over it counts all the traffic the test sent.
pub const RATE_INTERVAL: &str = "1m";

/// One query of a dashboard panel.
#[derive(Debug, Clone)]
pub struct PanelQuery {
    pub panel: String,
    pub ref_id: String,
    /// The `expr` as written in the dashboard.
    pub expr: String,
    /// [`PanelQuery::expr`] with the template variables replaced (see [`dashboard_queries`]).
    pub promql: String,
}

/// Every panel's queries in the dashboard JSON `text`. Template variables that offer "All"
/// take their `allValue` (a regex matching every value), as Grafana sends them with "All"
/// selected; `$__rate_interval`, `$__interval` and `$__range` take [`RATE_INTERVAL`]. A
/// variable the dashboard uses but does not define is an error, as is a panel without a query.
pub fn dashboard_queries(text: &str) -> Result<Vec<PanelQuery>> {
    let json: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| RigError::Other(format!("the dashboard is not JSON: {e}")))?;
    let mut values: Vec<(String, String)> = ["__rate_interval", "__interval", "__range"]
        .iter()
        .map(|name| ((*name).to_owned(), RATE_INTERVAL.to_owned()))
        .collect();
    let variables = json["templating"]["list"]
        .as_array()
        .ok_or_else(|| RigError::Other("the dashboard has no templating.list".into()))?;
    for variable in variables {
        let name = variable["name"].as_str().ok_or_else(|| {
            RigError::Other(format!("a template variable without a name: {variable}"))
        })?;
        if variable["type"] == "datasource" {
            continue;
        }
        let all = variable["allValue"]
            .as_str()
            .filter(|_| variable["includeAll"] == true);
        let value = all.ok_or_else(|| {
            RigError::Other(format!(
                "template variable {name} offers no \"All\" value for the test to select"
            ))
        })?;
        values.push((name.to_owned(), value.to_owned()));
    }
    // Longest names first, so that `$service` is not replaced inside `$services`.
    values.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));

    let panels = json["panels"]
        .as_array()
        .ok_or_else(|| RigError::Other("the dashboard has no panels".into()))?;
    let mut queries = Vec::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        let targets = panel["targets"]
            .as_array()
            .filter(|targets| !targets.is_empty())
            .ok_or_else(|| RigError::Other(format!("panel {title:?} has no queries")))?;
        for target in targets {
            let expr = target["expr"].as_str().ok_or_else(|| {
                RigError::Other(format!("panel {title:?}: a target without expr"))
            })?;
            let promql = substitute(expr, &values)
                .map_err(|e| RigError::Other(format!("panel {title:?}: {e}")))?;
            queries.push(PanelQuery {
                panel: title.clone(),
                ref_id: target["refId"].as_str().unwrap_or_default().to_owned(),
                expr: expr.to_owned(),
                promql,
            });
        }
    }
    Ok(queries)
}

/// `expr` with each `$name` and `${name}` of `values` replaced; an error names a `$` left over.
fn substitute(expr: &str, values: &[(String, String)]) -> std::result::Result<String, String> {
    let mut out = expr.to_owned();
    for (name, value) in values {
        out = out.replace(&format!("${{{name}}}"), value);
        out = out.replace(&format!("${name}"), value);
    }
    match out.find('$') {
        Some(at) => Err(format!("unknown template variable at {:?}", &out[at..])),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_all_values_and_intervals_and_refuses_unknown_variables() {
        let dashboard = r#"{
            "templating": {"list": [
                {"name": "datasource", "type": "datasource"},
                {"name": "service", "type": "query", "includeAll": true, "allValue": ".*"},
                {"name": "services", "type": "query", "includeAll": true, "allValue": "a|b"}
            ]},
            "panels": [{"title": "p", "targets": [
                {"refId": "A", "expr": "rate(x{name=~\"$service\", n=~\"${services}\"}[$__rate_interval])"}
            ]}]
        }"#;
        let queries = dashboard_queries(dashboard).expect("queries");
        assert_eq!(queries.len(), 1);
        assert_eq!(queries[0].promql, "rate(x{name=~\".*\", n=~\"a|b\"}[1m])");
        let unknown = dashboard.replace("$service\\\"", "$zone\\\"");
        assert!(dashboard_queries(&unknown).is_err());
        let no_all = dashboard.replace(
            "\"includeAll\": true, \"allValue\": \".*\"",
            "\"includeAll\": false",
        );
        assert!(dashboard_queries(&no_all).is_err());
    }
}

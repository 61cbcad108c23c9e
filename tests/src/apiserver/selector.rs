//! Label and field selectors as the API server parses them (the subset kube-proxy uses, plus
//! the equality forms): `key`, `!key`, `key=value`, `key==value`, `key!=value`, comma-joined;
//! fields `metadata.name` and `metadata.namespace`.

use std::collections::BTreeMap;

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Exists(String),
    NotExists(String),
    Equals(String, String),
    NotEquals(String, String),
}

/// A parsed `labelSelector` (empty: matches everything).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let requirement = if let Some(key) = part.strip_prefix('!') {
                Requirement::NotExists(valid_key(key)?)
            } else if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(valid_key(key)?, value.trim().to_owned())
            } else if let Some((key, value)) =
                part.split_once("==").or_else(|| part.split_once('='))
            {
                Requirement::Equals(valid_key(key)?, value.trim().to_owned())
            } else {
                Requirement::Exists(valid_key(part)?)
            };
            requirements.push(requirement);
        }
        Ok(Self(requirements))
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Exists(key) => labels.contains_key(key),
            Requirement::NotExists(key) => !labels.contains_key(key),
            Requirement::Equals(key, value) => labels.get(key) == Some(value),
            // As upstream: a missing label satisfies `!=`.
            Requirement::NotEquals(key, value) => labels.get(key) != Some(value),
        })
    }
}

fn valid_key(key: &str) -> Result<String, String> {
    let key = key.trim();
    let ok = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if ok {
        Ok(key.to_owned())
    } else {
        Err(format!("invalid label key {key:?}"))
    }
}

/// A parsed `fieldSelector`: equality on `metadata.name` / `metadata.namespace`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    name: Option<String>,
    namespace: Option<String>,
}

impl FieldSelector {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut selector = Self::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((field, value)) = part.split_once("==").or_else(|| part.split_once('='))
            else {
                return Err(format!("invalid field selector {part:?}"));
            };
            let value = Some(value.trim().to_owned());
            match field.trim() {
                "metadata.name" => selector.name = value,
                "metadata.namespace" => selector.namespace = value,
                // The real API server's wording for an unsupported field.
                other => return Err(format!("field label not supported: {other}")),
            }
        }
        Ok(selector)
    }

    pub fn matches(&self, name: &str, namespace: &str) -> bool {
        self.name.as_deref().is_none_or(|n| n == name)
            && self.namespace.as_deref().is_none_or(|n| n == namespace)
    }
}

/// Everything a list or watch request filters on.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// Namespaced request path (`/namespaces/NS/...`).
    pub namespace: Option<String>,
}

impl Filter {
    pub fn matches(&self, object: &Value) -> bool {
        let metadata = &object["metadata"];
        let name = metadata["name"].as_str().unwrap_or_default();
        let namespace = metadata["namespace"].as_str().unwrap_or_default();
        let labels: BTreeMap<String, String> = metadata["labels"]
            .as_object()
            .map(|labels| {
                labels
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        self.namespace.as_deref().is_none_or(|ns| ns == namespace)
            && self.fields.matches(name, namespace)
            && self.labels.matches(&labels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn kube_proxy_selector() {
        let s = LabelSelector::parse(
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name",
        )
        .unwrap();
        assert!(s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("service.kubernetes.io/headless", "")])));
        assert!(!s.matches(&labels(&[(
            "service.kubernetes.io/service-proxy-name",
            "x"
        )])));
    }

    #[test]
    fn equality_existence_and_errors() {
        let s = LabelSelector::parse("app=web,tier, env!=prod").unwrap();
        assert!(s.matches(&labels(&[("app", "web"), ("tier", "a")])));
        assert!(!s.matches(&labels(&[("app", "web")])));
        assert!(!s.matches(&labels(&[("app", "api"), ("tier", "a")])));
        assert!(!s.matches(&labels(&[("app", "web"), ("tier", "a"), ("env", "prod")])));
        assert!(LabelSelector::parse("").unwrap().matches(&labels(&[])));
        assert!(LabelSelector::parse("a b").is_err());
        let f = FieldSelector::parse("metadata.name=n1").unwrap();
        assert!(f.matches("n1", ""));
        assert!(!f.matches("n2", ""));
        assert!(FieldSelector::parse("spec.nodeName=x").is_err());
    }
}

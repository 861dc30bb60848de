//! A tenant's package policy: allow and deny rules (a project name with optional PEP 440 version
//! specifiers, parsed with `pep440_rs`) and a wheel size limit, set with `sandgate admin tenant
//! packages`. A refusal names the rule that refused.

use std::str::FromStr;

use pep440_rs::{Version, VersionSpecifiers};
use sandgate_store::packages::PackagePolicy;

use super::index::normalize;

/// One rule: `numpy`, `numpy>=1.26`, `requests!=2.31.0,<3`.
#[derive(Debug, Clone)]
pub struct Rule {
    text: String,
    project: String,
    versions: Option<VersionSpecifiers>,
}

impl Rule {
    /// Parses a rule; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let end = text
            .find(|c: char| !(c.is_ascii_alphanumeric() || "._-".contains(c)))
            .unwrap_or(text.len());
        let (name, rest) = text.split_at(end);
        if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            return Err(format!(
                "{text:?}: a rule is a project name, optionally with version specifiers (e.g. numpy or numpy>=1.26)"
            ));
        }
        let rest = rest.trim();
        let versions = if rest.is_empty() {
            None
        } else {
            Some(
                VersionSpecifiers::from_str(rest)
                    .map_err(|e| format!("{text:?}: version specifiers {rest:?}: {e}"))?,
            )
        };
        Ok(Self {
            text: text.to_owned(),
            project: normalize(name),
            versions,
        })
    }

    /// Whether the rule names `project` (normalized) at all.
    fn names(&self, project: &str) -> bool {
        self.project == project
    }

    /// Whether the rule covers this version of its project (any version without specifiers).
    fn covers(&self, version: &Version) -> bool {
        self.versions.as_ref().is_none_or(|v| v.contains(version))
    }

    /// The rule as written.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// A tenant's policy, parsed.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    allow: Vec<Rule>,
    deny: Vec<Rule>,
    /// The tenant's own wheel size limit, MiB.
    pub max_wheel_mb: Option<u64>,
}

/// What the policy says about one project.
#[derive(Debug)]
pub(super) enum ProjectVerdict {
    /// Refused whatever the version; the text names the rule.
    Refused(String),
    /// Some versions may be installed: `check` each.
    Versions,
}

impl Policy {
    /// Parses a stored policy; a rule that no longer parses is an error naming it.
    pub fn from_stored(stored: &PackagePolicy) -> Result<Self, String> {
        Ok(Self {
            allow: stored
                .allow
                .iter()
                .map(|r| Rule::parse(r))
                .collect::<Result<_, _>>()?,
            deny: stored
                .deny
                .iter()
                .map(|r| Rule::parse(r))
                .collect::<Result<_, _>>()?,
            max_wheel_mb: stored.max_wheel_mb.and_then(|m| u64::try_from(m).ok()),
        })
    }

    /// The verdict for a project before looking at versions.
    pub(super) fn project(&self, project: &str) -> ProjectVerdict {
        if let Some(rule) = self
            .deny
            .iter()
            .find(|r| r.names(project) && r.versions.is_none())
        {
            return ProjectVerdict::Refused(format!(
                "{project} is refused by your organisation's package policy (deny rule {:?}); ask an administrator to change it (sandgate admin tenant packages)",
                rule.text()
            ));
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|r| r.names(project)) {
            return ProjectVerdict::Refused(format!(
                "{project} is not on your organisation's list of allowed packages ({}); ask an administrator to allow it (sandgate admin tenant packages --allow)",
                self.allow
                    .iter()
                    .map(Rule::text)
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        ProjectVerdict::Versions
    }

    /// `None` when this version may be installed, else the rule that refuses it.
    pub(super) fn refuses_version(&self, project: &str, version: &str) -> Option<String> {
        let Ok(version) = Version::from_str(version) else {
            return Some("its version is not a PEP 440 version".into());
        };
        if let Some(rule) = self
            .deny
            .iter()
            .find(|r| r.names(project) && r.covers(&version))
        {
            return Some(format!("deny rule {:?}", rule.text()));
        }
        let allowing: Vec<&Rule> = self.allow.iter().filter(|r| r.names(project)).collect();
        if !allowing.is_empty() && !allowing.iter().any(|r| r.covers(&version)) {
            return Some(format!(
                "allow rule {}",
                allowing
                    .iter()
                    .map(|r| format!("{:?}", r.text()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy::from_stored(&PackagePolicy {
            allow: allow.iter().map(|s| (*s).to_owned()).collect(),
            deny: deny.iter().map(|s| (*s).to_owned()).collect(),
            max_wheel_mb: None,
        })
        .unwrap()
    }

    #[test]
    fn deny_rules_refuse_projects_or_versions_and_name_the_rule() {
        let p = policy(&[], &["Evil_Pkg", "numpy<2"]);
        let ProjectVerdict::Refused(why) = p.project("evil-pkg") else {
            panic!("evil-pkg is refused");
        };
        assert!(why.contains("deny rule \"Evil_Pkg\""), "{why}");
        assert!(matches!(p.project("numpy"), ProjectVerdict::Versions));
        assert_eq!(
            p.refuses_version("numpy", "1.26.4").as_deref(),
            Some("deny rule \"numpy<2\"")
        );
        assert_eq!(p.refuses_version("numpy", "2.1.0"), None);
    }

    #[test]
    fn an_allow_list_admits_only_what_it_names() {
        let p = policy(&["pandas>=2", "requests"], &[]);
        assert!(matches!(p.project("polars"), ProjectVerdict::Refused(_)));
        assert!(matches!(p.project("requests"), ProjectVerdict::Versions));
        assert!(p.refuses_version("pandas", "1.5.3").is_some());
        assert_eq!(p.refuses_version("pandas", "2.2.0"), None);
    }

    #[test]
    fn bad_rules_are_refused_with_the_reason() {
        assert!(Rule::parse(">=1").is_err());
        assert!(Rule::parse("numpy>=>1").unwrap_err().contains("numpy>=>1"));
        assert!(Rule::parse("numpy >= 1.26").is_ok());
    }
}

//! The login form as a client without a browser fills it in: load `/login` for its CSRF cookie
//! and token, then post the credentials. Shared by the end-to-end tests and the login-flood
//! benchmark (which includes this file by path).

/// A loaded login form: the CSRF cookie to send back and the token to post.
#[derive(Debug, Clone)]
pub struct LoginForm {
    /// `name=value` of the form's CSRF cookie.
    pub cookie: String,
    /// The form's hidden `csrf` field.
    pub csrf: String,
}

impl LoginForm {
    /// `GET <base>/login`.
    pub async fn load(http: &reqwest::Client, base: &str) -> reqwest::Result<LoginForm> {
        let page = http.get(format!("{base}/login")).send().await?;
        let cookie = page
            .headers()
            .get_all("set-cookie")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| v.split(';').next())
            .collect::<Vec<_>>()
            .join("; ");
        let body = page.text().await?;
        let csrf = body
            .split("name=\"csrf\" value=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_default()
            .to_owned();
        Ok(LoginForm { cookie, csrf })
    }

    /// `POST <base>/login` with the credentials and `next`.
    pub async fn submit(
        &self,
        http: &reqwest::Client,
        base: &str,
        email: &str,
        password: &str,
        next: &str,
    ) -> reqwest::Result<reqwest::Response> {
        http.post(format!("{base}/login"))
            .header("cookie", &self.cookie)
            .form(&[
                ("email", email),
                ("password", password),
                ("csrf", &self.csrf),
                ("next", next),
            ])
            .send()
            .await
    }
}
